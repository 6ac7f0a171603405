"""What one applied sample is worth, measured from the gradients a synchronous step already has.

Every synchronous step (sync, and each group step of hierarchical) holds two estimates of the same
true gradient G: this rank's own, over its `b` samples, and the allreduced average over all `B`
samples of the step. With per-sample gradient noise of total variance tr(S) their expected squared
norms are |G|^2 + tr(S)/b and |G|^2 + tr(S)/B, which gives unbiased estimates of both |G|^2 and
tr(S) (McCandlish et al., "An Empirical Model of Large-Batch Training"; Pollux/AdaptDL use the same
pair). Their ratio tr(S)/|G|^2 is the gradient noise scale: the batch size beyond which a bigger
batch stops buying progress per step.

The third figure is how far the gradient turns from one step to the next: the dot product of two
consecutive averaged gradients. Their noise is independent (different samples), so its mean is the
true <G_t, G_t-1>; divided by |G|^2 it is the correlation of consecutive true gradients, which says
what a gradient computed some steps ago is still worth now (what async's stale gradients cost).

Each figure is a bias-corrected exponential moving average (the noise of one step is large; the
controller reads the averages).

Async steps have no second estimate of the same gradient, but a worker's consecutive gradients are
over independent samples, so their dot products are unbiased: with g_t this worker's gradient,
E<g_t, g_t-1> = rho |G|^2 and E<g_t, g_t-2> = rho^2 |G|^2, where rho is the correlation over one of
this worker's steps (the model moved meanwhile by every worker's updates: about one synchronous
step's worth). So rho = lag2/lag1 and |G|^2 = lag1/rho, the geometric decay the controller's cost
model assumes (policy.efficiency); tr(S) = b (E|g_t|^2 - |G|^2). Without this the controller would
keep judging async by the figures of the synchronous steps before it, which age: the transformer
example's gradients turned from 0.98 to 0.2 correlation within 100 steps, after auto had gone async
on the first. Each stay in a mode (async, or synchronous after async) starts its averages afresh; the
figures are those of the mode the process last stepped in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Weight of the newest step in the moving averages: about the last 1/ALPHA steps count.
ALPHA = 0.05
# Below this two-step correlation an async worker's |G|^2 is taken from its gradients' norm (see _async_figures).
MIN_RHO = 0.05


@dataclass(frozen=True, slots=True)
class GradientFigures:
    """The averages so far. `sq_norm` (|G|^2) and `variance` (tr(S), per sample) are None until a
    step had a local batch smaller than the step's total; `lag_dot` until two consecutive ones."""

    steps: int
    sq_norm: float | None
    variance: float | None
    lag_dot: float | None


class _Average:
    """Exponential moving average, corrected for its start at zero (as Adam's moments are)."""

    def __init__(self) -> None:
        self.value = 0.0
        self.weight = 0.0

    def add(self, x: float) -> None:
        self.value = (1 - ALPHA) * self.value + ALPHA * x
        self.weight = (1 - ALPHA) * self.weight + ALPHA

    def get(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None


class GradientStats:
    """Fed by the synchronous exchange; one per process, kept across mode switches."""

    def __init__(self) -> None:
        self.steps = 0
        self._sq_norm = _Average()
        self._variance = _Average()
        self._lag_dot = _Average()
        self._previous: torch.Tensor | None = None
        self._async = False
        self._async_steps = 0
        self._async_own = _Average()
        self._async_lag1 = _Average()
        self._async_lag2 = _Average()
        self._async_batch = _Average()
        self._recent: list[torch.Tensor] = []  # this worker's last two async gradients, newest last

    def observe(self, local: torch.Tensor, local_batch: int, average: torch.Tensor, total_batch: int) -> None:
        """One synchronous step: this rank's gradient over `local_batch` samples and the average
        over the step's `total_batch` samples (both unscaled, in the same parameter order)."""
        if local_batch <= 0 or total_batch <= local_batch or not bool(torch.isfinite(average).all()):
            self._previous = None
            return
        # Float32 dot products (BLAS, no float64 copies): see observe_async.
        local, average = local.detach().to(torch.float32).flatten(), average.detach().to(torch.float32).flatten()
        own = float(torch.dot(local, local))
        avg = float(torch.dot(average, average))
        b, big = float(local_batch), float(total_batch)
        if self._async:  # back from async: the synchronous figures from before it have aged too
            self._async = False
            self.steps = 0
            self._sq_norm, self._variance, self._lag_dot = _Average(), _Average(), _Average()
        self._sq_norm.add((big * avg - b * own) / (big - b))
        self._variance.add((own - avg) / (1.0 / b - 1.0 / big))
        previous = self._previous
        if previous is not None and previous.shape == average.shape:
            self._lag_dot.add(float(torch.dot(previous, average)))
            previous.copy_(average)
        else:
            self._previous = average.detach().clone()
        self.steps += 1

    def observe_async(self, grad: torch.Tensor, batch: int) -> None:
        """One async step: this worker's (unscaled) gradient over `batch` samples (module doc)."""
        if batch <= 0 or not bool(torch.isfinite(grad).all()):
            self._recent = []
            return
        if not self._async:
            self.enter_async()
        # Float32 throughout (BLAS dot products, no float64 copies): a few milliseconds per million
        # parameters would otherwise be added to every async step.
        g = grad.detach().to(torch.float32).flatten()
        self._async_own.add(float(torch.dot(g, g)))
        self._async_batch.add(float(batch))
        recent = self._recent
        # Two gradients of memory, kept only while the job runs async; the oldest buffer is reused.
        if len(recent) == 2 and recent[0].shape == g.shape:
            self._async_lag1.add(float(torch.dot(g, recent[1])))
            self._async_lag2.add(float(torch.dot(g, recent[0])))
            self._async_steps += 1
            oldest = recent.pop(0)
            recent.append(oldest.copy_(g))
        else:
            self._recent = [*recent[-1:], g.clone()]

    def enter_async(self) -> None:
        """A new stay in async: its figures start afresh (those of an earlier stay have aged), and
        until it has measured some the controller is told nothing rather than the synchronous ones."""
        self._async = True
        self._async_steps = 0
        self._async_own, self._async_lag1, self._async_lag2 = _Average(), _Average(), _Average()
        self._async_batch = _Average()
        self._recent = []

    def interrupt(self) -> None:
        """The parameters jumped (a mode switch, a checkpoint load, a group average): the next step's
        gradient is not the continuation of the last one."""
        self._previous = None
        self._recent = []

    def figures(self) -> GradientFigures:
        if self._async:
            return self._async_figures()
        return GradientFigures(self.steps, self._sq_norm.get(), self._variance.get(), self._lag_dot.get())

    def _async_figures(self) -> GradientFigures:
        averages = (self._async_own, self._async_lag1, self._async_lag2, self._async_batch)
        own, lag1, lag2, batch = (a.get() for a in averages)
        if own is None or lag1 is None or lag2 is None or batch is None:
            return GradientFigures(self._async_steps, None, None, None)
        rho = min(1.0, max(0.0, lag2 / lag1)) if lag1 > 0 else 0.0
        # A gradient that decorrelates within two steps leaves |G|^2 unknowable from the lags; the
        # noisy norm bounds it from above, so the correlation then reads low (the cautious side).
        sq = lag1 / rho if rho >= MIN_RHO else own
        return GradientFigures(self._async_steps, sq, max(0.0, batch * (own - sq)), rho * sq)
