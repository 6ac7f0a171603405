"""When will the job be done: seconds to `training.target` (or to the last step) from measured progress.

Pure. Both shells keep a few recent (time, step) points and rank 0's latest validations, and show what
`predict` makes of them: the operator in `status.eta` and the ETA column, `sgdjob run` in its live view.

The pace is the steps per second over the kept points (recent intervals, so a rebalance or a mode
switch shows in the ETA within a few intervals). The step at which the target is reached is the
recent validations' trend carried forward in a straight line: learning curves flatten, so this is
an estimate that moves as validations come in, not a promise; a trend that does not approach the
target predicts nothing, and the ETA falls back to the last step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sgdjob_trainer.config import Target, TargetMetric

PACE_POINTS = 8  # (time, step) points kept: a few intervals, so the pace follows a change soon
TREND_POINTS = 4  # validations the trend is fitted on


@dataclass(frozen=True, slots=True)
class Eta:
    seconds: float
    basis: str  # "target" or "last step"

    @property
    def text(self) -> str:
        """'2h05m', '4m10s' or '35s': short enough for a kubectl column."""
        s = max(0, round(self.seconds))
        if s >= 3600:
            return f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 60:
            return f"{s // 60}m{s % 60:02d}s"
        return f"{s}s"


def pace(points: Sequence[tuple[float, int]]) -> float | None:
    """Steps per second from the first to the last (time, step) point; None before the job moved.
    A step that went back (a restart from an older checkpoint) starts the pace over from there."""
    start = 0
    for i in range(1, len(points)):
        if points[i][1] < points[i - 1][1]:
            start = i
    kept = points[start:]
    if len(kept) < 2:
        return None
    (t0, s0), (t1, s1) = kept[0], kept[-1]
    if t1 <= t0 or s1 <= s0:
        return None
    return (s1 - s0) / (t1 - t0)


def target_step(validations: Sequence[tuple[int, float]], value: float, higher_is_better: bool) -> float | None:
    """The step at which the recent validations' straight-line trend reaches `value` (the latest
    validation's step when it is reached already); None when the trend does not approach it."""
    if not validations:
        return None
    points = sorted(validations)[-TREND_POINTS:]
    last_step, last = points[-1]
    if (last >= value) if higher_is_better else (last <= value):
        return float(last_step)
    if len(points) < 2:
        return None
    mean_s = sum(s for s, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((s - mean_s) ** 2 for s, _ in points)
    if spread == 0:
        return None
    slope = sum((s - mean_s) * (v - mean_v) for s, v in points) / spread
    if slope == 0 or (slope > 0) != higher_is_better:
        return None
    return last_step + (value - last) / slope


def predict(
    points: Sequence[tuple[float, int]],
    last_step: int,
    validations: Sequence[tuple[int, float]] = (),
    target: tuple[float, bool] | None = None,
) -> Eta | None:
    """Seconds from the latest point until the target (value, higher_is_better) is reached, or
    until `last_step` when no target is set, the trend says nothing, or it lies beyond the last step."""
    rate = pace(points)
    if rate is None:
        return None
    now_step = points[-1][1]
    goal = target_step(validations, *target) if target is not None else None
    if goal is not None and goal <= last_step:
        return Eta(max(0.0, (goal - now_step) / rate), "target")
    return Eta(max(0.0, (last_step - now_step) / rate), "last step")


def keep_point(
    points: Sequence[tuple[float, int]], time: float, step: int, limit: int = PACE_POINTS
) -> list[tuple[float, int]]:
    """`points` with (time, step) appended, the oldest dropped past `limit`."""
    return [*points, (time, step)][-limit:]


def goal(target: Target) -> tuple[float, bool]:
    """The target as `predict` takes it: (value, higher_is_better)."""
    higher = target.metric is TargetMetric.ACCURACY or (target.metric is TargetMetric.METRIC and not target.minimize)
    return target.value, higher


def keep_validation(
    validations: Sequence[tuple[int, float]],
    target: Target,
    step: int | None,
    loss: float | None,
    accuracy: float | None,
    metric: float | None,
) -> list[tuple[int, float]]:
    """`validations` with rank 0's latest reading of the target's metric at `step` (once per step)."""
    value = {TargetMetric.ACCURACY: accuracy, TargetMetric.LOSS: loss, TargetMetric.METRIC: metric}[target.metric]
    if step is None or value is None or not math.isfinite(value):
        return list(validations)
    return [*(v for v in validations if v[0] != step), (step, value)][-TREND_POINTS:]
