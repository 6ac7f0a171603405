"""Predicted useful throughput of each way to run the job, from per-rank speeds and the network.

useful = samples/s x statistical efficiency (`policy.efficiency`: measured from the job's gradients
once the trainers have some steps in their current mode, else the prior 1 - stalenessPenalty x staleness).
The models follow what the trainer does:
- sync: every step waits for the slowest rank (plus noise: the slowest *this* step), then an
  allreduce; a rank's step is batch / speed, or, where its step times at two batches were fitted
  (`StepTime`, policy.speeds), a fixed part plus batch / rate;
- hierarchical: sync inside each group; a group runs at most `staleness` averaging rounds ahead
  of the slowest group, so in the long run every group moves at the slowest group's pace;
- async: each worker pushes to sharded parameter servers at its own pace; a gradient staler than
  the bound is dropped; the shards' push rate caps the whole job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.efficiency import Efficiency
from sgdjob_operator.policy.stats import gap_clusters

# Ranks whose steps at the job's batch are within this fraction of each other are one speed class for
# a split of sync's batch (`pooled`): a speed averaged over 5-10 steps of 5 % jitter is known to about
# 2 %, so two equal ranks read up to ~5 % apart.
# Fitted on the tuning set: bimodal, one-straggler, intermittent, transient; interval 0.5 s, seeds 0-2 (fb7ee30).
SAME_SPEED = 0.05


@dataclass(frozen=True, slots=True)
class CostInputs:
    comm: CommModel
    jitter: float
    efficiency: Efficiency
    average_every: int
    hier_staleness: int
    async_staleness: int | None
    ps_shards: int


@dataclass(frozen=True, slots=True)
class Prediction:
    label: str
    throughput: float
    staleness: float
    efficiency: float

    @property
    def useful(self) -> float:
        return self.throughput * self.efficiency


@dataclass(frozen=True, slots=True)
class StepTime:
    """A rank's compute seconds per step at batch b: `fixed + b / rate`."""

    rate: float
    fixed: float = 0.0

    def at(self, batch: int) -> float:
        return self.fixed + batch / self.rate


def step_times(
    speeds: Mapping[int, float], batches: Mapping[int, int], fixed: Mapping[int, float]
) -> dict[int, StepTime]:
    """Each rank's step-time model through its measured step at its current batch (`speeds` were
    measured at `batches`), so the current configuration's prediction is the measured one whatever
    the fit says; a rank without a fixed part (or one the measured step cannot hold) is proportional."""
    out: dict[int, StepTime] = {}
    for r, v in speeds.items():
        f = fixed.get(r, 0.0)
        step = batches[r] / v
        out[r] = StepTime(batches[r] / (step - f), f) if 0 < f < step else StepTime(v)
    return out


def pooled(steps: Mapping[int, StepTime], batch: int, within: float = SAME_SPEED) -> dict[int, StepTime]:
    """The ranks' step-time models with each speed class at its mean model. A class is a set of ranks
    whose steps at `batch` lie within `within` of each other and more than `within` from every other
    rank's: ranks the measurement cannot tell apart, in a fleet that has distinct speeds (equal
    accelerators, a slow pair). A split made from each rank's own estimate chases measurement noise:
    two equal ranks read 2 % apart get different batches, and the one the noise flattered sets every
    step (measured: a 2x-slower pair split 21/22 instead of 21/21, a 4 % longer step for the rest of
    the run). A fleet spread evenly (no gap wider than `within`) keeps its own estimates: a mean over
    ranks that really differ would hide its slowest member's step."""
    times = {r: st.at(batch) for r, st in steps.items()}
    out = dict(steps)
    # Clusters of steps per second at `batch`, cut at gaps wider than `within` (the health check's
    # clustering); a cluster wider than `within` end to end is an even spread, not a class.
    for members in gap_clusters({r: 1.0 / t for r, t in times.items() if t > 0}, 1 + within):
        if len(members) < 2 or times[members[-1]] > times[members[0]] * (1 + within):
            continue
        rate = sum(steps[q].rate for q in members) / len(members)
        fixed = sum(steps[q].fixed for q in members) / len(members)
        out.update({q: StepTime(rate, fixed) for q in members})
    return out


def _noise(ci: CostInputs, n: int) -> float:
    return 1.0 + ci.jitter * math.log(n) if n > 1 else 1.0


def predict_sync(
    speeds: Mapping[int, float],
    batches: Mapping[int, int],
    ci: CostInputs,
    label: str = "sync",
    lr_ratio: float = 1.0,
    steps: Mapping[int, StepTime] | None = None,
) -> Prediction:
    """`lr_ratio`: the per-sample learning rate relative to plain sync's (a resized world's rule);
    `steps`: fitted step times (`step_times`), which replace batch / speed for the ranks they hold."""
    n = len(speeds)
    if n == 0:
        return Prediction(label, 0.0, 0.0, 1.0)
    model = steps or {}
    slowest = max(model[r].at(batches[r]) if r in model else batches[r] / speeds[r] for r in speeds)
    step = slowest * _noise(ci, n) + ci.comm.allreduce_s(n)
    total = sum(batches[r] for r in speeds)
    eff = ci.efficiency
    worth = eff.per_sample(lr_ratio) * eff.batch_worth(total) * eff.sync_batch_worth(total)
    return Prediction(label, total / step, 0.0, worth)


def predict_hierarchical(
    speeds: Mapping[int, float],
    batches: Mapping[int, int],
    groups: Sequence[Sequence[int]],
    ci: CostInputs,
    label: str = "hierarchical",
) -> Prediction:
    groups = [[r for r in g if r in speeds] for g in groups]
    groups = [g for g in groups if g]
    n = sum(len(g) for g in groups)
    if len(groups) <= 1:
        return predict_sync(speeds, batches, ci, label)
    h, s = ci.average_every, ci.hier_staleness
    world_average = ci.comm.allreduce_s(n)
    paces = []
    for g in groups:
        step = max(batches[r] / speeds[r] for r in g) * _noise(ci, len(g)) + ci.comm.allreduce_s(len(g))
        # The cross-group average runs in the background for `s` rounds; only what outlasts
        # them is waited for (all of it with s = 0).
        exposed = max(0.0, world_average - s * h * step) / h
        paces.append(1.0 / (step + exposed))
    pace = min(paces)
    throughput = pace * sum(batches[r] for g in groups for r in g)
    # A rank sees its own group's gradients fresh and the other groups' about s*h + (h-1)/2
    # steps late; weight that age by the share of the world outside the rank's group.
    age = s * h + (h - 1) / 2
    staleness = sum(len(g) / n * age * (n - len(g)) / max(1, n - 1) for g in groups)
    # Each group steps its optimizer on its own batch: an adaptive optimizer's worth per group batch,
    # weighed by the group's share of the samples.
    group_batches = [sum(batches[r] for r in g) for g in groups]
    sized = sum(b * ci.efficiency.batch_worth(b) for b in group_batches) / max(1, sum(group_batches))
    return Prediction(label, throughput, staleness, ci.efficiency.stale(staleness) * sized)


def predict_async(
    speeds: Mapping[int, float],
    batches: Mapping[int, int],
    ci: CostInputs,
    measured_staleness: float | None = None,
    label: str = "async",
) -> Prediction:
    n = len(speeds)
    if n == 0:
        return Prediction(label, 0.0, 0.0, 1.0)
    rates = {r: 1.0 / (batches[r] / speeds[r] + ci.comm.ps_worker_s()) for r in speeds}
    total = sum(rates.values())
    capacity = ci.comm.ps_capacity(ci.ps_shards)
    if total > capacity:
        # Shards serve pushes in turn: past their capacity every worker slows alike.
        rates = {r: v * capacity / total for r, v in rates.items()}
        total = capacity
    applied = 0.0
    weighted = 0.0
    worth = 0.0
    pushes: list[tuple[float, float]] = []
    known = measured_staleness if measured_staleness is not None and measured_staleness > 0 else None
    for r, rate in rates.items():
        # Updates the other workers make during one of this worker's steps, per other worker.
        stale = (total - rate) / (rate * max(1, n - 1))
        if ci.async_staleness is not None and stale > ci.async_staleness:
            continue
        applied += batches[r] * rate
        weighted += batches[r] * rate * stale
        pushes.append((batches[r], rate))
        # Each update is at its own staleness (or what the workers report).
        age = known if known is not None else stale
        worth += batches[r] * rate * ci.efficiency.async_update(age, n)
    staleness = known if known is not None else (weighted / applied if applied > 0 else 0.0)
    # The applied pushes share the servers' optimizer state (an adaptive one's RMS is theirs together).
    shared = ci.efficiency.shared_worth(pushes)
    return Prediction(label, applied, staleness, shared * worth / applied if applied > 0 else 1.0)
