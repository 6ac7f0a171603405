"""What a local run looked like over time, folded from the runner's polls (pure).

The report's rank files hold totals; the plots need the run as it went: each rank's step time
between two polls, the job's throughput against its bound, the loss, and when the mode changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.local.progress import ProgressFrame


@dataclass(frozen=True, slots=True)
class RankPoint:
    time_s: float
    rank: int
    step_time_s: float  # wall seconds per step of this rank since the previous poll
    compute_per_step_s: float  # compute seconds per step (emulated compute included)


@dataclass(frozen=True, slots=True)
class JobPoint:
    time_s: float
    step: int
    samples_per_s: float | None
    bound_per_s: float
    loss: float | None
    mode: str


@dataclass(slots=True)
class Timeline:
    """Append one ProgressFrame per poll with `add`; `to_dict` is what report.json keeps as `timeline`."""

    ranks: list[RankPoint] = field(default_factory=list)
    job: list[JobPoint] = field(default_factory=list)
    mode_changes: list[tuple[float, str]] = field(default_factory=list)
    _last: ProgressFrame | None = None

    def add(self, snap: ProgressFrame) -> None:
        previous, self._last = self._last, snap
        self.job.append(JobPoint(snap.elapsed_s, snap.step, snap.samples_per_s, snap.bound_per_s, snap.loss, snap.mode))
        if snap.workers and (not self.mode_changes or self.mode_changes[-1][1] != snap.mode):
            self.mode_changes.append((snap.elapsed_s, snap.mode))
        if previous is None:
            return
        before = {w.rank: w for w in previous.workers}
        dt = snap.time - previous.time
        for worker in snap.workers:
            old = before.get(worker.rank)
            if old is None or not worker.fresh or worker.done:
                continue
            steps = worker.step - old.step
            if steps <= 0 or dt <= 0:
                continue
            self.ranks.append(
                RankPoint(snap.elapsed_s, worker.rank, dt / steps, max(0.0, worker.compute_s - old.compute_s) / steps)
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": [[p.time_s, p.rank, p.step_time_s, p.compute_per_step_s] for p in self.ranks],
            "mode_changes": [[t, mode] for t, mode in self.mode_changes],
            "job": [[p.time_s, p.step, p.samples_per_s, p.bound_per_s, p.loss, p.mode] for p in self.job],
        }
