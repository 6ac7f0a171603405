"""Job health from one window: per-rank speed, straggler flags with hysteresis, the fleet's shape."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sgdjob_operator.api.models import PolicySpec
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.measure import Window, next_rank_states, same_worker
from sgdjob_operator.policy.speeds import running_speed, step_overhead
from sgdjob_operator.policy.state import PolicyState, RankState, SpeedEstimate
from sgdjob_operator.policy.stats import gap_clusters, log_spread, median, robust_scores

# Weight of the newest observation in the learned jitter coefficient.
JITTER_EMA = 0.3


class Shape(StrEnum):
    """How the ranks' speeds differ. SINGLE_STRAGGLER: one slow node among other nodes (one slow
    rank where every rank shares one node); CLUSTERS: speed classes, each even within; TRANSIENT: a
    difference seen for fewer than persistenceIntervals windows; UNKNOWN: too few ranks measured
    this window."""

    HOMOGENEOUS = "homogeneous"
    SINGLE_STRAGGLER = "singleStraggler"
    CLUSTERS = "clusters"
    DISPERSED = "dispersed"
    TRANSIENT = "transient"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class RankHealth:
    """`ratio` is the median speed over this rank's speed: its step time relative to the median's
    at equal batch (3.0 = three times slower). `measured` is False for a rank whose speed is the
    last known one (restarted, idle or missing this window). `evidence`: the steps its speed rests
    on at its current batch and mode; `fixed`: the seconds of its step that do not grow with the
    batch, where its step times at two batches tell (else 0.0; see speeds.py); `error`: its speed's
    relative standard error, where enough windows tell (`state.SpeedEstimate.error`); `windows`: the
    windows its estimate sums (decayed); `noise`: the relative error its speed has by the rank's
    window-to-window noise (`state.SpeedEstimate.noise`); `steady_ratio`: `ratio` at the ranks' steady
    speeds (`state.SpeedEstimate.steady`), what a membership change rests on."""

    rank: int
    node: str | None
    pod: str | None
    speed: float
    ratio: float
    score: float
    flagged: bool
    streak: int
    measured: bool
    evidence: float = 0.0
    fixed: float = 0.0
    error: float | None = None
    windows: float = 0.0
    noise: float | None = None
    steady_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class JobHealth:
    shape: Shape
    raw_shape: Shape
    ranks: Mapping[int, RankHealth]
    median_speed: float
    spread: float
    stragglers: tuple[int, ...]
    suspects: tuple[int, ...]
    clusters: tuple[tuple[int, ...], ...]
    missing: tuple[int, ...]
    restarted: tuple[int, ...]
    measured: int
    throughput: float
    step: int
    loss: float | None
    summary: str

    def speeds(self) -> dict[int, float]:
        return {r: h.speed for r, h in self.ranks.items()}

    def fixed_seconds(self) -> dict[int, float]:
        """Each rank's fitted fixed seconds per step, for the ranks that have one."""
        return {r: h.fixed for r, h in self.ranks.items() if h.fixed > 0}

    def straggler_records(self) -> list[dict[str, Any]]:
        """Persistent stragglers in the shape of the status' `stragglers` list."""
        out: list[dict[str, Any]] = []
        for r in self.stragglers:
            h = self.ranks[r]
            out.append({"rank": r, "pod": h.pod, "node": h.node, "slowdown": round(h.ratio, 3)})
        return out

    def rank_line(self) -> str:
        """Each rank's speed, slowdown and what it rests on, for a debug log: why a rank was flagged."""

        def part(h: RankHealth) -> str:
            noise = "-" if h.noise is None else f"{h.noise:.3f}"
            error = "-" if h.error is None else f"{h.error:.3f}"
            flag = f" flagged {h.streak}" if h.flagged else ""
            return (
                f"{h.rank} {h.speed:.4g}/s {h.ratio:.2f}x (steady {h.steady_ratio:.2f}x) noise {noise} "
                f"error {error} windows {h.windows:.1f}{flag}"
            )

        return "; ".join(part(h) for h in self.ranks.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.value,
            "rawShape": self.raw_shape.value,
            "summary": self.summary,
            "medianSpeed": self.median_speed,
            "spread": self.spread,
            "stragglers": self.straggler_records(),
            "suspects": list(self.suspects),
            "clusters": [list(c) for c in self.clusters],
            "missing": list(self.missing),
            "restarted": list(self.restarted),
            "measured": self.measured,
            "throughput": self.throughput,
            "step": self.step,
            "loss": self.loss,
        }


@dataclass(frozen=True, slots=True)
class Assessment:
    health: JobHealth
    ranks: dict[int, RankState]
    heterogeneous: bool
    shape_key: str
    shape_streak: int


def _node_key(rank: int, node: str | None) -> str:
    return node if node is not None else f"rank-{rank}"


def _fingerprint(ranks: set[int] | list[int]) -> str:
    """Short stable identity of a set of ranks: a shape persists only while the same ranks are
    slow (hiccups on a different node each window are no persistent shape)."""
    return f"{zlib.crc32(','.join(map(str, sorted(ranks))).encode()):08x}"


def _straggler_units(speeds: Mapping[int, float], nodes: Mapping[int, str | None]) -> dict[int, str]:
    """What a single straggler is one of, for each measured rank: its node, or the rank itself
    where every measured rank shares one node (one agent with nprocPerNode > 1, the local runner):
    there "one slow node, no other node" would name any slow group of ranks a single straggler."""
    keys = {r: _node_key(r, nodes.get(r)) for r in speeds}
    if len(set(keys.values())) > 1:
        return keys
    return {r: f"rank-{r}" for r in speeds}


def _raw_shape(
    speeds: Mapping[int, float], flagged: set[int], nodes: Mapping[int, str | None], p: PolicySpec
) -> tuple[Shape, str]:
    units = _straggler_units(speeds, nodes)
    slow_units = {units[r] for r in flagged}
    # The rest of the fleet, without the slow node's other ranks (they may sit just under the
    # threshold while their node degrades).
    others = [v for r, v in speeds.items() if units[r] not in slow_units]
    if len(slow_units) == 1 and log_spread(others) < p.straggler_threshold:
        return Shape.SINGLE_STRAGGLER, f"{Shape.SINGLE_STRAGGLER.value}:{next(iter(slow_units))}"
    clusters = gap_clusters(speeds, p.recover_threshold)
    if len(clusters) >= 2 and all(log_spread([speeds[r] for r in c]) < p.straggler_threshold for c in clusters):
        slower = [r for c in clusters[1:] for r in c]
        return Shape.CLUSTERS, f"{Shape.CLUSTERS.value}:{len(clusters)}:{_fingerprint(slower)}"
    return Shape.DISPERSED, f"{Shape.DISPERSED.value}:{_fingerprint(flagged)}"


@dataclass(frozen=True, slots=True)
class _Classified:
    measured: dict[int, float]
    ranks: dict[int, RankState]
    heterogeneous: bool
    raw: Shape
    key: str
    spread: float


def _running(
    window: Window, olds: Mapping[int, RankState | None], p: PolicySpec, afresh: bool
) -> dict[int, tuple[float, SpeedEstimate | None]]:
    """Each measured rank's speed and running estimate (see speeds.py); `afresh`: from this window only."""
    out: dict[int, tuple[float, SpeedEstimate | None]] = {}
    for r, w in window.ranks.items():
        old = olds[r]
        previous = old.estimate if old is not None else None
        out[r] = running_speed(previous, w, r in window.from_start, p.recover_threshold, afresh)
    return out


def _classify(
    running: Mapping[int, tuple[float, SpeedEstimate | None]],
    olds: Mapping[int, RankState | None],
    window: Window,
    state: PolicyState,
    p: PolicySpec,
) -> _Classified:
    measured = {r: speed for r, (speed, _) in running.items()}
    enough = len(measured) >= max(2, math.ceil(window.world_size / 2))
    med = median(list(measured.values())) if measured else 0.0
    flags: dict[int, tuple[float, bool, SpeedEstimate | None]] = {}
    for r, (speed, estimate) in running.items():
        ratio = med / speed
        old = olds[r]
        was_flagged = old is not None and old.flagged
        flags[r] = speed, ratio >= p.straggler_threshold or (was_flagged and ratio > p.recover_threshold), estimate
    ranks = next_rank_states(state.ranks, window, flags)
    nodes = {r: s.node for r, s in ranks.items()}
    spread = log_spread(list(measured.values()))
    heterogeneous = state.heterogeneous
    raw, key = Shape.UNKNOWN, state.shape
    if enough:
        if spread >= p.straggler_threshold:
            heterogeneous = True
        elif spread < p.recover_threshold:
            heterogeneous = False
        flagged_now = {r for r in measured if ranks[r].flagged}
        raw, key = (
            (Shape.HOMOGENEOUS, Shape.HOMOGENEOUS.value)
            if not heterogeneous
            else _raw_shape(measured, flagged_now, nodes, p)
        )
    return _Classified(measured, ranks, heterogeneous, raw, key, spread)


def assess(window: Window, state: PolicyState, p: PolicySpec) -> Assessment:
    """Flags a rank slower than the median by stragglerThreshold, unflags it below
    recoverThreshold (hysteresis), and names the fleet's shape, persistent or transient.

    Speeds are the running estimates of speeds.py, except when the fleet's shape changed: the
    windows before it describe other conditions (a rank that slowed by less than recoverThreshold
    would otherwise be averaged with its old speed for several windows), so every estimate then
    starts over from this window."""
    olds = {r: same_worker(state.ranks.get(r), window.latest[r]) for r in window.ranks}  # None: a new worker
    c = _classify(_running(window, olds, p, afresh=False), olds, window, state, p)
    if state.shape and c.raw is not Shape.UNKNOWN and c.key != state.shape:
        c = _classify(_running(window, olds, p, afresh=True), olds, window, state, p)
    measured, ranks, heterogeneous, raw, key, spread = (c.measured, c.ranks, c.heterogeneous, c.raw, c.key, c.spread)
    streak = state.shape_streak + 1 if key == state.shape else 1
    if raw is Shape.UNKNOWN:
        streak = state.shape_streak
    shape = raw if raw in (Shape.HOMOGENEOUS, Shape.UNKNOWN) or streak >= p.persistence_intervals else Shape.TRANSIENT

    known = {r: s.speed for r, s in ranks.items() if s.speed is not None and s.speed > 0}
    center = median(list(known.values())) if known else 0.0
    scores = robust_scores(known)
    steady = {r: _steady_speed(ranks[r], v) for r, v in known.items()}
    steady_center = median(list(steady.values())) if steady else 0.0
    table = {
        r: RankHealth(
            rank=r,
            node=ranks[r].node,
            pod=window.latest[r].pod if r in window.latest else None,
            speed=v,
            ratio=center / v,
            score=scores.get(r, 0.0),
            flagged=ranks[r].flagged,
            streak=ranks[r].streak,
            measured=r in measured,
            evidence=_evidence(ranks[r], window, r),
            fixed=step_overhead(ranks[r].estimate),
            error=_error(ranks[r]),
            windows=_windows(ranks[r]),
            noise=_noise(ranks[r]),
            steady_ratio=steady_center / steady[r],
        )
        for r, v in sorted(known.items())
    }
    stragglers = tuple(r for r, h in table.items() if h.flagged and h.streak >= p.persistence_intervals)
    suspects = tuple(r for r, h in table.items() if h.flagged and h.streak < p.persistence_intervals)
    clusters = tuple(tuple(sorted(c)) for c in gap_clusters(known, p.recover_threshold))
    throughput = sum(w.samples / w.seconds for w in window.ranks.values())
    losses = [s.loss for s in window.latest.values() if s.loss is not None]
    health = JobHealth(
        shape=shape,
        raw_shape=raw,
        ranks=table,
        median_speed=center,
        spread=spread,
        stragglers=stragglers,
        suspects=suspects,
        clusters=clusters,
        missing=window.missing,
        restarted=window.restarted,
        measured=len(measured),
        throughput=throughput,
        step=max((s.steps for s in window.latest.values()), default=0),
        loss=sum(losses) / len(losses) if losses else None,
        summary=_summary(shape, raw, table, clusters, spread, streak, p),
    )
    return Assessment(health, ranks, heterogeneous, key, streak)


def _steady_speed(state: RankState, speed: float) -> float:
    return state.estimate.steady if state.estimate is not None else speed


def _error(state: RankState) -> float | None:
    return state.estimate.error if state.estimate is not None else None


def _noise(state: RankState) -> float | None:
    return state.estimate.noise if state.estimate is not None else None


def _windows(state: RankState) -> float:
    return state.estimate.windows if state.estimate is not None else 0.0


def _evidence(state: RankState, window: Window, rank: int) -> float:
    if state.estimate is not None:
        return state.estimate.steps
    w = window.ranks.get(rank)
    return float(w.steps) if w is not None else 0.0


def _summary(
    shape: Shape,
    raw: Shape,
    table: Mapping[int, RankHealth],
    clusters: tuple[tuple[int, ...], ...],
    spread: float,
    streak: int,
    p: PolicySpec,
) -> str:
    if shape is Shape.UNKNOWN:
        return "not enough ranks measured this window"
    if shape is Shape.TRANSIENT:
        # What is seen, named as a persistent shape would be (a change made at once names its rank).
        seen = _summary(raw, raw, table, clusters, spread, streak, p)
        return f"transient: {seen}, seen for {streak}/{p.persistence_intervals} intervals"
    if shape is Shape.HOMOGENEOUS:
        return f"homogeneous: fastest/slowest {spread:.2f}x"
    if shape is Shape.SINGLE_STRAGGLER:
        worst = max((h for h in table.values() if h.flagged), key=lambda h: h.ratio, default=None)
        if worst is not None:
            return (
                f"single straggler: rank {worst.rank} on {worst.node or 'an unknown node'} "
                f"is {worst.ratio:.2f}x slower than the median"
            )
    if shape is Shape.CLUSTERS:
        parts = [
            f"{len(c)} ranks at {median([table[r].speed for r in c if r in table] or [0.0]):.4g}/s" for c in clusters
        ]
        return f"{len(clusters)} speed clusters: " + ", ".join(parts)
    return f"dispersed: fastest/slowest {spread:.2f}x"


def jitter_coefficient(window: Window, comm: CommModel, previous: float) -> float:
    """Learn how much a synchronous step loses to per-step noise: in sync every rank waits for the
    slowest *this step*, so the wall time per step exceeds the slowest mean compute by noise plus
    the allreduce. What the alpha-beta model does not explain is taken as noise, expressed per
    ln(ranks) (the expected maximum of n noisy times grows roughly with ln n). Only a window where
    every measured rank ran sync teaches it; other windows keep the previous value."""
    rates = list(window.ranks.values())
    n = len(rates)
    if n < 2 or any(w.mode != "sync" for w in rates):
        return previous
    comm = comm.with_gradient_bytes(window.gradient_bytes) if window.gradient_bytes else comm
    wall = median([w.wall_per_step for w in rates])
    slowest = max(w.compute_per_step for w in rates)
    excess = wall - slowest - comm.allreduce_s(n)
    observed = max(0.0, excess) / (slowest * math.log(n))
    return observed if previous == 0.0 else (1 - JITTER_EMA) * previous + JITTER_EMA * observed
