"""Per-rank rates over one window: differences between this scrape and the last one kept in state.

Counters are cumulative per process, so a counter that went down (or a rank that moved to another
node) means the process restarted: that rank gets a new baseline and no rate this window. A rank
that made no step (or whose clock did not move) has no rate either; a rank that sent nothing is
missing. None of these are mistaken for a slow rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.state import RankState

# Float counters round-trip through text; a decrease smaller than this is not a restart.
_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class RankWindow:
    """One rank's work between two scrapes. `speed` is samples per second of compute: the rate the
    rank would reach if it never waited (in sync every rank's wall time is the same, so wall time
    says nothing about who is slow; compute time does)."""

    rank: int
    node: str | None
    pod: str | None
    mode: str
    seconds: float
    steps: int
    samples: int
    compute: float
    wait: float
    batch_size: int
    staleness: float
    speed: float

    @property
    def compute_per_step(self) -> float:
        return self.compute / self.steps

    @property
    def wait_per_step(self) -> float:
        return self.wait / self.steps

    @property
    def wall_per_step(self) -> float:
        return (self.compute + self.wait) / self.steps


@dataclass(frozen=True, slots=True)
class Window:
    ranks: Mapping[int, RankWindow]
    baseline: tuple[int, ...]
    restarted: tuple[int, ...]
    idle: tuple[int, ...]
    missing: tuple[int, ...]
    latest: Mapping[int, WorkerSample]
    gradient_bytes: int
    world_size: int


def latest_by_rank(samples: Iterable[WorkerSample], world_size: int) -> dict[int, WorkerSample]:
    """The newest sample of each rank inside the world (a rank can appear twice while a pod is
    being replaced; ranks beyond the world belong to a membership that is going away)."""
    out: dict[int, WorkerSample] = {}
    for s in samples:
        if 0 <= s.rank < world_size and (s.rank not in out or s.time > out[s.rank].time):
            out[s.rank] = s
    return out


def _reset(prev: RankState, s: WorkerSample) -> bool:
    moved = prev.node is not None and s.node is not None and prev.node != s.node
    return (
        moved
        or s.steps < prev.steps
        or s.samples < prev.samples
        or s.compute_seconds < prev.compute - _EPS
        or s.comm_wait_seconds < prev.wait - _EPS
    )


def measure(previous: Mapping[int, RankState], samples: Iterable[WorkerSample], world_size: int) -> Window:
    latest = latest_by_rank(samples, world_size)
    ranks: dict[int, RankWindow] = {}
    baseline: list[int] = []
    restarted: list[int] = []
    idle: list[int] = []
    for rank, s in sorted(latest.items()):
        prev = previous.get(rank)
        if prev is None:
            baseline.append(rank)
            continue
        if _reset(prev, s):
            restarted.append(rank)
            continue
        seconds = s.time - prev.time
        steps = s.steps - prev.steps
        compute = s.compute_seconds - prev.compute
        samples_done = s.samples - prev.samples
        # Async counts only applied samples (a gradient too stale is dropped), yet the rank did the
        # work: its speed is steps x batch over compute time.
        work = steps * s.batch_size if s.mode == "async" and s.batch_size > 0 else samples_done
        if seconds <= 0 or steps <= 0 or compute <= _EPS or work <= 0:
            idle.append(rank)
            continue
        ranks[rank] = RankWindow(
            rank=rank,
            node=s.node,
            pod=s.pod,
            mode=s.mode,
            seconds=seconds,
            steps=steps,
            samples=samples_done,
            compute=compute,
            wait=max(0.0, s.comm_wait_seconds - prev.wait),
            batch_size=s.batch_size,
            staleness=s.staleness,
            speed=work / compute,
        )
    missing = tuple(r for r in range(world_size) if r not in latest)
    gradient_bytes = max((s.gradient_bytes for s in latest.values()), default=0)
    return Window(ranks, tuple(baseline), tuple(restarted), tuple(idle), missing, latest, gradient_bytes, world_size)


def next_rank_states(
    previous: Mapping[int, RankState], window: Window, flags: Mapping[int, tuple[float, bool]]
) -> dict[int, RankState]:
    """Counters to difference against next time, with each measured rank's new (speed, flagged);
    other ranks carry their speed, streak and flag over."""
    out: dict[int, RankState] = {}
    for rank, s in window.latest.items():
        prev = previous.get(rank)
        moved = prev is not None and prev.node is not None and s.node is not None and prev.node != s.node
        if rank in flags:
            assert prev is not None
            speed, flagged = flags[rank]
            streak = prev.streak + 1 if flagged else 0
        elif prev is None or moved:
            # A new process on a new node is a new worker; a restart on the same node keeps its
            # speed estimate and streak.
            speed, flagged, streak = None, False, 0
        else:
            speed, flagged, streak = prev.speed, prev.flagged, prev.streak
        out[rank] = RankState(
            s.time, s.steps, s.samples, s.compute_seconds, s.comm_wait_seconds, s.node, speed, streak, flagged
        )
    # Missing ranks keep their last state: a scrape that failed once must not erase a streak.
    for rank, prev in previous.items():
        if rank not in out and rank < window.world_size:
            out[rank] = prev
    return out
