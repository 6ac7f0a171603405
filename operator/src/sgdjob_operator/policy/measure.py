"""Per-rank rates over one window: differences between this scrape and the last one kept in state.

Counters are cumulative per process, so a counter that went down (or a rank that moved to another
node, or a process whose training began after the last sample) means the process restarted. A rank
that made no step (or whose clock did not move) has no rate; a rank that sent nothing is missing.
None of these are mistaken for a slow rank.

A rank seen for the first time, or restarted, has no previous sample to difference against. When
its sample says how long the process has trained (`WorkerSample.training_seconds`), its counters
were all zero at the start of training, so its first window runs from that implicit zero to now
and it has a rate at once, if that window is neither too short nor too long (`FirstWindow`).
Otherwise it gets a baseline (or, restarted, a new one) and no rate this window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.state import RankState, SpeedEstimate

# Float counters round-trip through text; a decrease smaller than this is not a restart.
_EPS = 1e-6
# A first window from the training start, in policy intervals: at least half of one (a shorter one
# would weigh a few steps' jitter like a whole interval's), at most two (a rank that trained longer
# before the policy saw it, e.g. after the policy's state was dropped, would be averaged over
# conditions the policy never saw).
FIRST_WINDOW_SHORTEST = 0.5
FIRST_WINDOW_LONGEST = 2.0


@dataclass(frozen=True, slots=True)
class FirstWindow:
    """How long, in seconds, a window from a process's training start may be to give a first rate."""

    shortest: float
    longest: float

    @classmethod
    def for_interval(cls, interval_s: float) -> FirstWindow:
        return cls(FIRST_WINDOW_SHORTEST * interval_s, FIRST_WINDOW_LONGEST * interval_s)


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
    """`baseline`: ranks seen for the first time, without a rate; `restarted`: ranks whose process
    restarted (measured from its training start when `from_start` holds them too); `from_start`:
    ranks whose window ran from their process's training start instead of a previous sample."""

    ranks: Mapping[int, RankWindow]
    baseline: tuple[int, ...]
    restarted: tuple[int, ...]
    idle: tuple[int, ...]
    missing: tuple[int, ...]
    latest: Mapping[int, WorkerSample]
    gradient_bytes: int
    world_size: int
    from_start: tuple[int, ...] = ()


def latest_by_rank(samples: Iterable[WorkerSample], world_size: int) -> dict[int, WorkerSample]:
    """The newest sample of each rank inside the world (a rank can appear twice while a pod is
    being replaced; ranks beyond the world belong to a membership that is going away)."""
    out: dict[int, WorkerSample] = {}
    for s in samples:
        if 0 <= s.rank < world_size and (s.rank not in out or s.time > out[s.rank].time):
            out[s.rank] = s
    return out


def _moved(prev: RankState, s: WorkerSample) -> bool:
    return prev.node is not None and s.node is not None and prev.node != s.node


def same_worker(prev: RankState | None, s: WorkerSample) -> RankState | None:
    """`prev` when `s` comes from the same worker (a restart on the same node is the same worker,
    keeping its speed estimate and streak); None for a new one (first seen, or on another node)."""
    return None if prev is None or _moved(prev, s) else prev


def _began_after(prev: RankState, s: WorkerSample) -> bool:
    """The process began training after `prev` was taken, yet `prev` had counted steps: a new
    process. (A `prev` of zeros, taken before training began, is a fine start for a window.)"""
    return s.training_seconds is not None and prev.steps > 0 and s.time - s.training_seconds > prev.time


def _reset(prev: RankState, s: WorkerSample) -> bool:
    return (
        _moved(prev, s)
        or _began_after(prev, s)
        or s.steps < prev.steps
        or s.samples < prev.samples
        or s.compute_seconds < prev.compute - _EPS
        or s.comm_wait_seconds < prev.wait - _EPS
    )


def training_origin(s: WorkerSample, first: FirstWindow | None) -> RankState | None:
    """The implicit sample of zeros at the process's training start, when the sample dates it and
    the window from it to `s` is within `first`'s bounds."""
    trained = s.training_seconds
    if first is None or trained is None or not first.shortest <= trained <= first.longest:
        return None
    return RankState(s.time - trained, 0, 0, 0.0, 0.0, s.node)


def measure(
    previous: Mapping[int, RankState],
    samples: Iterable[WorkerSample],
    world_size: int,
    first: FirstWindow | None = None,
) -> Window:
    """Each rank's window since its previous sample; with `first`, a rank seen for the first time or
    restarted is measured from its training start when its sample dates it (see the module's doc)."""
    latest = latest_by_rank(samples, world_size)
    ranks: dict[int, RankWindow] = {}
    baseline: list[int] = []
    restarted: list[int] = []
    from_start: list[int] = []
    idle: list[int] = []
    for rank, s in sorted(latest.items()):
        prev = previous.get(rank)
        if prev is None or _reset(prev, s):
            if prev is not None:
                restarted.append(rank)
            origin = training_origin(s, first)
            if origin is None:
                if prev is None:
                    baseline.append(rank)
                continue
            from_start.append(rank)
            prev = origin
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
    return Window(
        ranks,
        tuple(baseline),
        tuple(restarted),
        tuple(idle),
        missing,
        latest,
        gradient_bytes,
        world_size,
        tuple(from_start),
    )


def next_rank_states(
    previous: Mapping[int, RankState],
    window: Window,
    flags: Mapping[int, tuple[float, bool, SpeedEstimate | None]],
) -> dict[int, RankState]:
    """Counters to difference against next time, with each measured rank's new (speed, flagged,
    running estimate); other ranks carry their speed, streak, flag and estimate over."""
    out: dict[int, RankState] = {}
    for rank, s in window.latest.items():
        same = same_worker(previous.get(rank), s)
        if rank in flags:
            # A new worker measured from its training start begins its streak here.
            speed, flagged, estimate = flags[rank]
            streak = (same.streak if same is not None else 0) + 1 if flagged else 0
        elif same is None:
            # A new process on a new node is a new worker; a restart on the same node keeps its
            # speed estimate and streak.
            speed, flagged, streak, estimate = None, False, 0, None
        else:
            speed, flagged, streak, estimate = same.speed, same.flagged, same.streak, same.estimate
        out[rank] = RankState(
            s.time, s.steps, s.samples, s.compute_seconds, s.comm_wait_seconds, s.node, speed, streak, flagged, estimate
        )
    # Missing ranks keep their last state: a scrape that failed once must not erase a streak.
    for rank, prev in previous.items():
        if rank not in out and rank < window.world_size:
            out[rank] = prev
    return out
