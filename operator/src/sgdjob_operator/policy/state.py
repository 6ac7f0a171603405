"""The policy's memory between evaluations, as explicit JSON-serialisable data.

The operator keeps it in the SGDJob's status, so an operator restart resumes with the same
baselines, streaks and cooldown: nothing the policy needs lives only in memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.policy.progress import Progress
from sgdjob_operator.policy.trial import Discount, Trial

STATE_VERSION = 1
# Columns of the per-rank table: columns instead of one object per rank keep a 1024-rank state
# compact enough for an object's status.
_RANK_COLUMNS = ("rank", "time", "steps", "samples", "compute", "wait", "node", "speed", "streak", "flagged")
# Columns of the running speed estimate (see speeds.py); a state written before them reads as no estimate.
_ESTIMATE_COLUMNS = (
    "estWork",
    "estCompute",
    "estSteps",
    "estBatch",
    "estMode",
    "estPriorBatch",
    "estPriorStep",
    "estWindows",
    "estLogSum",
    "estLogSquares",
    "estSpikeSquares",
    "estSpikeWindows",
    "estLastJump",
    "estSteadyWork",
    "estSteadyCompute",
)
_ESTIMATE_FIELDS = (
    "work",
    "compute",
    "steps",
    "batch",
    "mode",
    "prior_batch",
    "prior_step",
    "windows",
    "log_sum",
    "log_squares",
    "spike_squares",
    "spike_windows",
    "last_jump",
    "steady_work",
    "steady_compute",
)
# Windows an estimate must sum (decayed: five windows in a row make 4.1) before the spread of their
# speeds says how well it is known.
# Fitted on the tuning set with splits.RESPLIT_SIGMAS: bimodal, interval 0.5 s, seeds 0-2 (a417476).
MIN_SPREAD_WINDOWS = 4.0
# Windows a rank's spikes must be looked for in before they say how noisy it is (`SpeedEstimate.noise`):
# a spike needs two departures, and a third window tells a quiet rank from a jumpy one.
MIN_SPIKE_WINDOWS = 2.0


@dataclass(frozen=True, slots=True)
class SpeedEstimate:
    """A rank's work and compute summed (with a slow decay) over the windows since its batch or mode
    last changed or its speed last jumped: `work / compute` is its speed, more precise the longer
    the configuration runs; `steps` how many steps it rests on. `prior_batch`/`prior_step`: the
    rank's compute seconds per step at the batch it ran before this one in the same mode (0: none),
    the second point of its step-time fit (speeds.step_overhead). `windows`, `log_sum`, `log_squares`:
    the windows summed and the sums of their speeds' logarithms and squared logarithms (decayed
    alike), whose spread says how well the speed is known (`error`). `spike_squares`, `spike_windows`:
    the squared spikes of the rank's windows (speeds.py: a departure from the estimate before that
    the next window took back, as a log ratio) and the windows they were looked for in (decayed
    alike), carried into every estimate that follows, so the rank's window-to-window noise is known
    when a new estimate starts (`noise`); `last_jump`: the last window's departure, signed.
    `steady_work`, `steady_compute`: the same sums over the windows since the mode last changed,
    decayed fast (speeds.STEADY_WINDOWS) and not started over when the speed jumps or the batch changes
    (`steady`): what a membership change rests on (candidates.steady_straggler)."""

    work: float
    compute: float
    steps: float
    batch: int
    mode: str
    prior_batch: int = 0
    prior_step: float = 0.0
    windows: float = 0.0
    log_sum: float = 0.0
    log_squares: float = 0.0
    spike_squares: float = 0.0
    spike_windows: float = 0.0
    last_jump: float = 0.0
    steady_work: float = 0.0
    steady_compute: float = 0.0

    @property
    def speed(self) -> float:
        return self.work / self.compute

    @property
    def steady(self) -> float:
        """The rank's speed over its last few windows in this mode, whatever they departed by
        (speeds.STEADY_WINDOWS); its estimate's speed where none is summed (a state from before)."""
        return self.steady_work / self.steady_compute if self.steady_compute > 0 else self.speed

    @property
    def error(self) -> float | None:
        """The speed's relative standard error, from how much the summed windows' speeds differ
        (None before MIN_SPREAD_WINDOWS windows). Measured rather than derived from the step count:
        a window's noise (another tenant, a thermal state) is shared by its steps and does not
        average out over them."""
        if self.windows < MIN_SPREAD_WINDOWS:
            return None
        mean = self.log_sum / self.windows
        variance = max(0.0, self.log_squares / self.windows - mean * mean)
        return math.sqrt(variance / (self.windows - 1.0))

    @property
    def noise(self) -> float | None:
        """The relative error of a speed resting on this estimate's windows, from the rank's
        window-to-window noise: the root mean square of its windows' spikes over the square root of
        the windows summed (None before MIN_SPIKE_WINDOWS windows were looked at). Where `error`
        starts over with every estimate, and a rank whose windows keep departing keeps restarting its
        estimate so never shows its spread, this says what a speed from its first windows is worth."""
        if self.spike_windows < MIN_SPIKE_WINDOWS:
            return None
        return math.sqrt(self.spike_squares / self.spike_windows) / math.sqrt(max(1.0, self.windows))


@dataclass(frozen=True, slots=True)
class RankState:
    """The last counters seen from one rank, its last measured speed and its straggler streak."""

    time: float
    steps: int
    samples: int
    compute: float
    wait: float
    node: str | None = None
    speed: float | None = None
    streak: int = 0
    flagged: bool = False
    estimate: SpeedEstimate | None = None


@dataclass(frozen=True, slots=True)
class PolicyState:
    """`shape` is the last window's raw heterogeneity signature and `shape_streak` how many windows
    in a row it held; `candidate`/`candidate_streak` the same for the change the cost model prefers;
    `heterogeneous` the hysteresis flag of the fleet's spread; `jitter` the learned compute-noise
    coefficient (see health.jitter_coefficient); `last_change` the time of the last change and
    `last_pause` of the last one that paused training (not a new split of sync's batch);
    `progress` the measured useful progress of the configuration in force, `trial` the last change
    while it is checked against it, `discounts` the changes taken back for under-delivering
    (`policy.check`). A state written before the last three reads as none of them. `settled`: the
    last signature that held for persistenceIntervals windows, the fleet that progress is tallied on
    and a change is checked and discounted on (a state from before it takes the next window's)."""

    ranks: Mapping[int, RankState] = field(default_factory=dict)
    heterogeneous: bool = False
    shape: str = ""
    shape_streak: int = 0
    candidate: str | None = None
    candidate_streak: int = 0
    last_change: float | None = None
    last_pause: float | None = None
    jitter: float = 0.0
    evaluations: int = 0
    progress: Progress = field(default_factory=Progress)
    trial: Trial | None = None
    discounts: tuple[Discount, ...] = ()
    settled: str = ""

    def to_dict(self) -> dict[str, Any]:
        ordered = sorted(self.ranks.items())
        table: dict[str, list[Any]] = {
            "rank": [r for r, _ in ordered],
            "time": [s.time for _, s in ordered],
            "steps": [s.steps for _, s in ordered],
            "samples": [s.samples for _, s in ordered],
            "compute": [s.compute for _, s in ordered],
            "wait": [s.wait for _, s in ordered],
            "node": [s.node for _, s in ordered],
            "speed": [s.speed for _, s in ordered],
            "streak": [s.streak for _, s in ordered],
            "flagged": [s.flagged for _, s in ordered],
        }
        estimates = [s.estimate for _, s in ordered]
        for column, attr in zip(_ESTIMATE_COLUMNS, _ESTIMATE_FIELDS, strict=True):
            table[column] = [None if e is None else getattr(e, attr) for e in estimates]
        return {
            "version": STATE_VERSION,
            "ranks": table,
            "heterogeneous": self.heterogeneous,
            "shape": self.shape,
            "shapeStreak": self.shape_streak,
            "settledShape": self.settled,
            "candidate": self.candidate,
            "candidateStreak": self.candidate_streak,
            "lastChange": self.last_change,
            "lastPause": self.last_pause,
            "jitter": self.jitter,
            "evaluations": self.evaluations,
            "progress": self.progress.to_dict(),
            "trial": None if self.trial is None else self.trial.to_dict(),
            "discounts": [d.to_dict() for d in self.discounts],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PolicyState:
        """Parse `to_dict` output. None or {} is a fresh state; a state of another version is
        dropped (a fresh baseline costs one interval); malformed data raises ValueError."""
        if not data or data.get("version") != STATE_VERSION:
            return cls()
        try:
            table = data.get("ranks") or {}
            columns = [list(table.get(c, [])) for c in _RANK_COLUMNS]
            if len({len(c) for c in columns}) > 1:
                raise ValueError("rank columns differ in length")
            estimates = [list(table.get(c) or [None] * len(columns[0])) for c in _ESTIMATE_COLUMNS]
            if any(len(c) != len(columns[0]) for c in estimates):
                raise ValueError("estimate columns differ in length")
            ranks: dict[int, RankState] = {}
            rows = zip(*columns, zip(*estimates, strict=True), strict=True)
            for rank, time, steps, samples, compute, wait, node, speed, streak, flagged, est in rows:
                ranks[int(rank)] = RankState(
                    time=_finite(time),
                    steps=int(steps),
                    samples=int(samples),
                    compute=_finite(compute),
                    wait=_finite(wait),
                    node=None if node is None else str(node),
                    speed=None if speed is None else _finite(speed),
                    streak=int(streak),
                    flagged=bool(flagged),
                    estimate=_estimate(est),
                )
            last_change = data.get("lastChange")
            # A state from before lastPause: every change counted as one that paused.
            last_pause = data.get("lastPause", last_change)
            return cls(
                ranks=ranks,
                heterogeneous=bool(data.get("heterogeneous", False)),
                shape=str(data.get("shape", "")),
                shape_streak=int(data.get("shapeStreak", 0)),
                settled=str(data.get("settledShape", "")),
                candidate=None if data.get("candidate") is None else str(data["candidate"]),
                candidate_streak=int(data.get("candidateStreak", 0)),
                last_change=None if last_change is None else _finite(last_change),
                last_pause=None if last_pause is None else _finite(last_pause),
                jitter=_finite(data.get("jitter", 0.0)),
                evaluations=int(data.get("evaluations", 0)),
                progress=Progress.from_dict(data.get("progress")),
                trial=Trial.from_dict(data.get("trial")),
                discounts=tuple(Discount.from_dict(d) for d in data.get("discounts") or ()),
            )
        except (TypeError, ValueError, AttributeError, KeyError) as err:
            raise ValueError(f"malformed policy state: {err}") from err


def _estimate(row: tuple[Any, ...]) -> SpeedEstimate | None:
    (
        work,
        compute,
        steps,
        batch,
        mode,
        prior_batch,
        prior_step,
        windows,
        log_sum,
        log_squares,
        spike_sq,
        spikes,
        last,
        steady_work,
        steady_compute,
    ) = row
    if work is None:
        return None
    # A state written before the step-time fit (or the window spread, the departures, the steady sums)
    # lacks those columns: no prior point (no spread, no noise, no steady speed known yet).
    out = SpeedEstimate(
        _finite(work),
        _finite(compute),
        _finite(steps),
        int(batch),
        str(mode),
        int(prior_batch or 0),
        _finite(prior_step or 0.0),
        _finite(windows or 0.0),
        _finite(log_sum or 0.0),
        _finite(log_squares or 0.0),
        _finite(spike_sq or 0.0),
        _finite(spikes or 0.0),
        _finite(last or 0.0),
        _finite(steady_work or 0.0),
        _finite(steady_compute or 0.0),
    )
    if out.compute <= 0 or out.work <= 0:
        raise ValueError("a speed estimate needs positive work and compute")
    if out.prior_batch < 0 or out.prior_step < 0:
        raise ValueError("a speed estimate's prior point needs a non-negative batch and step time")
    if out.steady_work < 0 or out.steady_compute < 0:
        raise ValueError("a speed estimate's steady sums must be non-negative")
    if out.windows < 0 or out.log_squares < 0 or out.spike_squares < 0 or out.spike_windows < 0:
        raise ValueError("a speed estimate's window counts and squared sums must be non-negative")
    return out


def _finite(value: Any) -> float:
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{value!r} is not a finite number")
    return out
