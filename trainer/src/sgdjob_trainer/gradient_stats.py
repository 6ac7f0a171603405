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
controller reads the averages). Async steps add nothing: the figures keep their last synchronous
values, which the controller keeps using while the job runs async.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Weight of the newest step in the moving averages: about the last 1/ALPHA steps count.
ALPHA = 0.05


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

    def observe(self, local: torch.Tensor, local_batch: int, average: torch.Tensor, total_batch: int) -> None:
        """One synchronous step: this rank's gradient over `local_batch` samples and the average
        over the step's `total_batch` samples (both unscaled, in the same parameter order)."""
        if local_batch <= 0 or total_batch <= local_batch or not bool(torch.isfinite(average).all()):
            self._previous = None
            return
        own = float(local.double().pow(2).sum())
        avg = float(average.double().pow(2).sum())
        b, big = float(local_batch), float(total_batch)
        self._sq_norm.add((big * avg - b * own) / (big - b))
        self._variance.add((own - avg) / (1.0 / b - 1.0 / big))
        previous = self._previous
        if previous is not None and previous.shape == average.shape:
            self._lag_dot.add(float(torch.dot(previous.double(), average.double())))
            previous.copy_(average)
        else:
            self._previous = average.detach().clone()
        self.steps += 1

    def interrupt(self) -> None:
        """The parameters jumped (a mode switch, a checkpoint load, a group average): the next step's
        gradient is not the continuation of the last one."""
        self._previous = None

    def figures(self) -> GradientFigures:
        return GradientFigures(self.steps, self._sq_norm.get(), self._variance.get(), self._lag_dot.get())
