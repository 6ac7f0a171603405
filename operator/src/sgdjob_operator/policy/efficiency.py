"""Statistical efficiency: what one applied sample is worth, relative to one of plain synchronous SGD.

Throughput counts samples; a stale gradient or an update at a damped learning rate moves the model
less per sample. The cost model multiplies each configuration's samples/s by this worth, estimated
from the job's own gradients (`GradientSignal`, measured by the trainers on every step of the mode they
are in: synchronous pairs of own and averaged gradients in sync and in hierarchical groups, and each
worker's consecutive gradients in async and where a hierarchical group is one rank: trainer gradient_stats):

- rho = <G_t, G_t-1>/|G|^2, the correlation of consecutive true gradients: how far the gradient
  field turns in one synchronous step. A gradient computed `a` synchronous steps before it is
  applied is worth rho^a of a fresh one (its component along today's gradient).
- Progress per sample is proportional to the learning rate per sample (first order in the step):
  the same for every batch size under the trainer's linear lrScaling (a resized world; async weighs
  each update by b/B), scaled by async's damping (training.async.stalenessLr) and by a sqrt or
  none lrScaling rule when the world shrinks.
- Bn = tr(S)/|G|^2, the gradient noise scale (samples; McCandlish et al., as Pollux/AdaptDL measure
  it), is reported with every decision. For a synchronous update over B samples, fewer than the
  job's global batch B0 (a trimmed split, a world without its slow rank), under a linear lrScaling
  and a plain (non-adaptive) optimizer, a sample is worth (Bn + B0)/(Bn + B) of one in a plain step:
  the samples a given progress needs grow as 1 + B/Bn (McCandlish et al.; Pollux's rule) when the
  learning rate suits each batch, and the learning rate that suits a batch grows about linearly
  with it while B <= Bn, which is the trainer's linear rule applied downwards from the rate the user
  tuned at B0. Measured: DDP on 3 of 4 workers (96 samples) reached the benchmark's target in 5-10 %
  fewer samples than sync over 128 at the same learning rate per sample, where the rule at the
  measured Bn (261-325) says 8-9 % (bench/HISTORY.md). Never credited upwards (B > B0: a learning rate
  scaled up past what was tuned is where the rule's premise fails), nor to async or hierarchical
  updates, whose per-update rates (b/B weighting, local steps then averaging) are not the rule's.
  The second-order term that would carry the batch size without a re-tuned rate needs the curvature
  along the gradient, which rho gives only loosely (tried: near the edge of stability it outweighed
  staleness, and a job whose gradient turned by 70 % per step was sent to async).
- An adaptive optimizer (Adam, RMSprop, Adagrad: the trainers say so, sgdjob_optimizer_adaptive)
  divides each step by the running RMS of its gradients, which for an update over b samples is
  about sqrt(|G|^2 + tr(S)/b): the noisier the update, the shorter its step along G. An update
  over b samples (one async worker's batch, one group's) is then worth sqrt((1 + Bn/B)/(1 + Bn/b))
  of one over sync's global batch B per sample, at the same learning rate per sample: 1 while the
  noise is small against b, down to sqrt(b/B) when it dominates (async on 4 equal workers: 1/2).
  Here Bn does change the worth. Capped at 1: the first-order model is not trusted to promise a
  gain from a larger batch. Async's pushes share one optimizer state (the parameter server's), so
  the RMS that divides every push is the pushes' common one, which the noisiest (smallest) batches
  dominate: each push is worth sqrt((1 + Bn/B) / mean(1 + Bn/b)), the mean over pushes (weighted
  by how often each worker pushes), not its own batch's figure. A rebalanced split left a slow
  worker a batch of 1 to 3 samples: in async it pushes most often, and its noise damped the fast
  workers' steps too (real-node charlm under AdamW, seed 117 at f075fca: async predicted +130 % from
  the own-batch figure, measured -98 %; bench/README).

Until the trainers have averaged MIN_STEPS steps in their current mode, or when they do not say, the prior
applies: a gradient s steps stale is worth 1 - stalenessPenalty x s, and nothing else changes the
worth of a sample. Every decision says which of the two it rested on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_trainer.config import StalenessLr

# Averages over fewer steps than this are too noisy to decide on (the trainer's moving
# average weighs about its last 20 steps).
MIN_STEPS = 10
# The gradient correlation is read only while the noise scale is at most this many global batches
# (see `estimate`): beyond, its error can exceed 0.3.
TRUSTED_NOISE_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class Efficiency:
    """`noise_scale` None: not measured (the prior applies); inf: the true gradient is lost in the
    noise (batch size is then free, and `correlation` unknown). `correlation` is per synchronous step."""

    penalty: float
    damping: str = "none"
    noise_scale: float | None = None
    correlation: float | None = None
    # The steps the figures rest on: the best-measured rank's (`estimate`).
    steps: int = 0
    ranks: int = 0
    adaptive: bool = False
    # Sync's global batch (samples per synchronous step): the batch an adaptive optimizer's worth is relative to.
    reference_batch: int = 0
    # The mode whose steps the figures were measured over (each stay in a mode measures afresh).
    measured_in: str = "sync"
    # training.lrScaling is linear: the learning rate follows the global batch (module doc).
    linear_lr: bool = False

    @property
    def measured(self) -> bool:
        return self.noise_scale is not None

    def per_sample(self, lr_ratio: float = 1.0) -> float:
        """Progress per sample of an update at `lr_ratio` x plain sync's per-sample learning rate."""
        return lr_ratio if self.measured else 1.0

    def batch_worth(self, batch: float) -> float:
        """Per-sample worth of an update over `batch` samples relative to one over `reference_batch`:
        below 1 only for an adaptive optimizer with a measured noise scale (module doc)."""
        return self.shared_worth(((batch, 1.0),))

    def shared_worth(self, pushes: Iterable[tuple[float, float]]) -> float:
        """Per-sample worth of updates that share one adaptive optimizer's state, relative to one
        over `reference_batch`: `pushes` are (batch, updates per second) of each source; every update
        is divided by their common gradient RMS (module doc). 1 for a plain optimizer or unmeasured."""
        pushes = [(b, r) for b, r in pushes if b > 0 and r > 0]
        if not self.adaptive or not self.measured or not pushes or self.reference_batch <= 0:
            return 1.0
        rate = sum(r for _, r in pushes)
        noise = self.noise_scale or 0.0
        if math.isinf(noise):
            # The RMS is the noise alone: tr(S)/b on average over the pushes, against sync's tr(S)/B.
            inverse = sum(r / b for b, r in pushes) / rate
            return min(1.0, math.sqrt(1.0 / (self.reference_batch * inverse)))
        spread = sum(r * (1.0 + noise / b) for b, r in pushes) / rate
        return min(1.0, math.sqrt((1.0 + noise / self.reference_batch) / spread))

    def sync_batch_worth(self, batch: float) -> float:
        """Per-sample worth of a synchronous update over `batch` samples relative to one over
        `reference_batch`, from the measured noise scale (module doc: above 1 only for a smaller batch
        of a plain optimizer under linear lrScaling; an adaptive optimizer's is `batch_worth`)."""
        if self.adaptive or not self.linear_lr or not self.measured or batch <= 0 or batch >= self.reference_batch:
            return 1.0
        noise = self.noise_scale or 0.0
        if math.isinf(noise):
            return 1.0
        return (noise + self.reference_batch) / (noise + batch)

    def stale(self, age: float) -> float:
        """Worth of a gradient computed `age` synchronous steps before it is applied."""
        if self.correlation is None:
            return max(0.0, 1.0 - self.penalty * age)
        return float(max(0.0, self.correlation) ** max(0.0, age))

    def async_update(self, staleness: float, world: int) -> float:
        """Worth per sample of one async update whose gradient is `staleness` steps old in the
        trainer's unit (the steps the average other worker took meanwhile: about staleness x (N-1)/N
        synchronous steps of movement, since each update weighs b/B), at the learning-rate damping the
        trainer applies to it; an adaptive optimizer's shared damping (`shared_worth`) comes on top."""
        if not self.measured:
            return max(0.0, 1.0 - self.penalty * staleness)
        age = staleness * (world - 1) / world if world > 1 else 0.0
        damped = self.per_sample(StalenessLr(self.damping).factor(staleness))
        return self.stale(age) * damped

    def describe(self) -> str:
        if not self.measured:
            return f"statistical efficiency assumed (stalenessPenalty {self.penalty:g}; no gradient statistics yet)"
        noise = "noise-dominated" if math.isinf(self.noise_scale or 0.0) else f"{self.noise_scale:.3g} samples"
        corr = "unknown, staleness assumed" if self.correlation is None else f"{self.correlation:.3f}"
        adaptive = "; adaptive optimizer: smaller updates count less" if self.adaptive else ""
        if self.linear_lr and not self.adaptive and not math.isinf(self.noise_scale or 0.0):
            adaptive = "; linear lrScaling: a smaller sync batch counts more per sample"
        return (
            f"statistical efficiency measured over {self.steps} steps in {self.measured_in} on {self.ranks} ranks "
            f"(gradient noise scale {noise}, step-to-step gradient correlation {corr}{adaptive})"
        )


def estimate(
    samples: Iterable[WorkerSample],
    penalty: float,
    damping_rule: str = "none",
    global_batch: int = 0,
    lr_scaling: str = "",
) -> Efficiency:
    """Average the ranks' gradient statistics (each rank's estimates are unbiased and noisy; their
    mean is less noisy) into the efficiency model; the prior when too few steps are measured.

    The correlation is trusted only while the noise scale is at most TRUSTED_NOISE_RATIO x the
    step's `global_batch`: one step's <G_t, G_t-1> carries noise of up to tr(S)/B, so the averaged
    correlation's error is up to (Bn/B)/sqrt(~40 steps); a job near its noise floor (Bn >> B) reads
    as a gradient that turns at random, and its staleness falls back to the prior."""
    samples = list(samples)
    measuring = [s for s in samples if s.gradient is not None and s.gradient.steps >= MIN_STEPS]
    measured = [s.gradient for s in measuring if s.gradient is not None]
    linear = lr_scaling == "linear"
    mode = "/".join(sorted({s.mode for s in measuring}))
    adaptive = any(s.adaptive_optimizer for s in samples)
    prior = Efficiency(penalty, damping_rule)
    if not measured:
        return prior
    n = len(measured)
    sq = sum(g.sq_norm for g in measured) / n
    var = max(0.0, sum(g.variance for g in measured) / n)
    lags = [g.lag_dot for g in measured if g.lag_dot is not None]
    # The evidence is the best-measured rank's steps, not the fewest: in async a slow rank crosses
    # MIN_STEPS long after the fast ones, and the fewest would then fall back to MIN_STEPS, so a stay
    # that had rested on 30 steps of the ranks pushing most of its updates would count as unmeasured
    # again (its check's windows stop counting) until the slow rank had 30 too. In sync every rank
    # has the same steps, in hierarchical within a few rounds of each other.
    steps = max(g.steps for g in measured)
    if not math.isfinite(sq) or not math.isfinite(var):
        return prior
    if sq <= 0.0:
        return Efficiency(penalty, damping_rule, math.inf, None, steps, n, adaptive, global_batch, mode, linear)
    noise = var / sq
    trusted = global_batch <= 0 or noise <= TRUSTED_NOISE_RATIO * global_batch
    corr = max(-1.0, min(1.0, sum(lags) / len(lags) / sq)) if lags and trusted else None
    return Efficiency(penalty, damping_rule, noise, corr, steps, n, adaptive, global_batch, mode, linear)
