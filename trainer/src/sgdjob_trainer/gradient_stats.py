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
model assumes (policy.efficiency); tr(S) = b (E|g_t|^2 - |G|^2). These hold only where the lags are
told apart from zero: each product also carries the samples' noise (about tr(S)/b), so where the
noise scale is many times the batch the averaged lags are noise of either sign. An async worker's
figures are then unknown (as the synchronous correlation is there, policy.efficiency), not a
correlation of 0: on real nodes a job with a noise scale of 428 samples at 16 a rank went async on a
6x straggler, read "correlation 0.000" off 45 steps of such lags and left async at once. Lags that
stand below zero are unknown too: gradients that oscillate across a valley turn negative from one
step to the next while training progresses along it, and a two-standard-error test repeated every
interval on every rank fails by chance within a minute (measured in CI: async left after step 253 on a
negative lag). Async's worth is then judged by its measured progress (the policy's check of a change).

Without the async figures the controller would keep judging async by the figures of the synchronous
steps before it, which age: the transformer example's gradients turned from 0.98 to 0.2 correlation
within 100 steps, after auto had gone async on the first.

Hierarchical measures as well: a group of two or more ranks allreduces its gradients every step, so
its steps give the synchronous pair (own and group average; consecutive group averages are not paired
across a cross-group model average, which moves the parameters); a rank alone in its group has only
its own gradients, and measures them as an async worker does. Without this a job that went
hierarchical on its first steps' correlation (near 1 while the loss falls steeply) would keep being
judged by it: measured here, digits-mlp chose hierarchical at step 19 on a correlation of 1.000 and
stayed. Each stay in a mode starts its averages afresh (`enter`); the figures are those of the mode
the process is in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Weight of the newest step in the moving averages: about the last 1/ALPHA steps count.
ALPHA = 0.05
# An async worker's lag is told from zero when its average is this many standard errors away: two,
# a one-sided chance of about 2.5 % that independent noise alone reads as a correlation or its absence.
LAG_Z = 2.0


@dataclass(frozen=True, slots=True)
class GradientFigures:
    """The averages so far. `sq_norm` (|G|^2) and `variance` (tr(S), per sample) are None until a
    step had a local batch smaller than the step's total; `lag_dot` until two consecutive ones."""

    steps: int
    sq_norm: float | None
    variance: float | None
    lag_dot: float | None


class _Average:
    """Exponential moving average, corrected for its start at zero (as Adam's moments are), with the
    standard error of that weighted mean (from the weighted second moment)."""

    def __init__(self) -> None:
        self.value = 0.0
        self.square = 0.0
        self.weight = 0.0
        self.weight_sq = 0.0  # sum of the squared weights: the effective count is weight^2 / weight_sq

    def add(self, x: float) -> None:
        self.value = (1 - ALPHA) * self.value + ALPHA * x
        self.square = (1 - ALPHA) * self.square + ALPHA * x * x
        self.weight = (1 - ALPHA) * self.weight + ALPHA
        self.weight_sq = (1 - ALPHA) ** 2 * self.weight_sq + ALPHA**2

    def get(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None

    def error(self) -> float:
        """The standard error of `get()`: the samples' spread (unbiased for the weights) over the root
        of their effective count; infinite before two samples."""
        count = self.weight**2 / self.weight_sq if self.weight_sq > 0 else 0.0
        if count <= 1.0 + 1e-9:
            return math.inf
        mean = self.value / self.weight
        spread = max(0.0, self.square / self.weight - mean * mean) * count / (count - 1.0)
        return math.sqrt(spread / count)


class _Pairs:
    """Synchronous steps: this rank's gradient and the average of the step (module doc)."""

    def __init__(self) -> None:
        self.steps = 0
        self.sq_norm, self.variance, self.lag_dot = _Average(), _Average(), _Average()
        self.previous: torch.Tensor | None = None

    def observe(self, local: torch.Tensor, local_batch: int, average: torch.Tensor, total_batch: int) -> None:
        if local_batch <= 0 or total_batch <= local_batch or not bool(torch.isfinite(average).all()):
            self.previous = None
            return
        # Float32 dot products (BLAS, no float64 copies): see _Lags.observe.
        local, average = local.detach().to(torch.float32).flatten(), average.detach().to(torch.float32).flatten()
        own = float(torch.dot(local, local))
        avg = float(torch.dot(average, average))
        b, big = float(local_batch), float(total_batch)
        self.sq_norm.add((big * avg - b * own) / (big - b))
        self.variance.add((own - avg) / (1.0 / b - 1.0 / big))
        previous = self.previous
        if previous is not None and previous.shape == average.shape:
            self.lag_dot.add(float(torch.dot(previous, average)))
            previous.copy_(average)
        else:
            self.previous = average.detach().clone()
        self.steps += 1

    def figures(self) -> GradientFigures:
        return GradientFigures(self.steps, self.sq_norm.get(), self.variance.get(), self.lag_dot.get())


class _Lags:
    """One rank's consecutive gradients, over independent samples (module doc)."""

    def __init__(self) -> None:
        self.steps = 0
        self.own, self.lag1, self.lag2, self.batch = _Average(), _Average(), _Average(), _Average()
        self.recent: list[torch.Tensor] = []  # the last two gradients, newest last

    def observe(self, grad: torch.Tensor, batch: int) -> None:
        if batch <= 0 or not bool(torch.isfinite(grad).all()):
            self.recent = []
            return
        # Float32 throughout (BLAS dot products, no float64 copies): a few milliseconds per million
        # parameters would otherwise be added to every step.
        g = grad.detach().to(torch.float32).flatten()
        self.own.add(float(torch.dot(g, g)))
        self.batch.add(float(batch))
        recent = self.recent
        # Two gradients of memory, kept only while the stay uses them; the oldest buffer is reused.
        if len(recent) == 2 and recent[0].shape == g.shape:
            self.lag1.add(float(torch.dot(g, recent[1])))
            self.lag2.add(float(torch.dot(g, recent[0])))
            self.steps += 1
            oldest = recent.pop(0)
            recent.append(oldest.copy_(g))
        else:
            self.recent = [*recent[-1:], g.clone()]

    def figures(self) -> GradientFigures:
        own, lag1, lag2, batch = (a.get() for a in (self.own, self.lag1, self.lag2, self.batch))
        unknown = GradientFigures(self.steps, None, None, None)
        if own is None or lag1 is None or lag2 is None or batch is None or own <= 0:
            return unknown
        if lag1 <= LAG_Z * self.lag1.error() or lag2 <= LAG_Z * self.lag2.error():
            # Either lag is the samples' noise (module doc); so is rho, a ratio with it on either side.
            # A lag below zero is no verdict either (module doc): it leaves the check of measured progress.
            return unknown
        sq = lag1 / min(1.0, lag2 / lag1)  # |G|^2 = lag1 / rho
        return GradientFigures(self.steps, sq, max(0.0, batch * (own - sq)), lag1)


class GradientStats:
    """One per process, fed by the active mode's steps; each stay in a mode measures afresh."""

    def __init__(self) -> None:
        self.mode = ""
        self._pairs = _Pairs()
        self._lags = _Lags()

    def enter(self, mode: str) -> None:
        """A mode starts (also on a restart or a new batch in the same mode): a different mode than the
        last one measures afresh, since the figures of another mode's steps have aged meanwhile."""
        self.interrupt()
        if mode != self.mode:
            self.mode = mode
            self._pairs, self._lags = _Pairs(), _Lags()

    def observe(self, local: torch.Tensor, local_batch: int, average: torch.Tensor, total_batch: int) -> None:
        """One synchronous step (whole world, or a hierarchical group): this rank's gradient over
        `local_batch` samples and the average over the step's `total_batch` samples (both unscaled,
        in the same parameter order)."""
        self._pairs.observe(local, local_batch, average, total_batch)

    def observe_own(self, grad: torch.Tensor, batch: int) -> None:
        """One step with no second estimate of the gradient (async; a hierarchical group of one):
        this rank's (unscaled) gradient over `batch` samples."""
        self._lags.observe(grad, batch)

    def interrupt(self) -> None:
        """The parameters jumped (a mode switch, a checkpoint load, a cross-group average): the next
        step's gradient is not the continuation of the last one."""
        self._pairs.previous = None
        self._lags.recent = []

    def figures(self) -> GradientFigures:
        # A stay feeds one of the two: synchronous pairs where the rank has them, else its own lags.
        return self._pairs.figures() if self._pairs.steps > 0 or self._lags.steps == 0 else self._lags.figures()
