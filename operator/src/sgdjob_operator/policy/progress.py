"""Measured useful progress of the configuration in force: what a change is checked against.

Each window in which the whole world ran the configuration adds its useful samples per second: the
samples per second the ranks applied (counted, not modelled) times what one of them is worth in this
configuration at the statistical efficiency the trainers measure in it now (`policy.efficiency`).
The sum restarts when the configuration changes and when the fleet's shape does (a window before a
straggler came describes another fleet; the shape once it has held for persistenceIntervals windows,
`engine.settled_shape`, since a name that flickers with the ranks' noise is no new fleet), and old
windows decay as a speed's do (`stats.MEMORY_WINDOWS`), so the tally says what this configuration
delivers on this fleet lately, and the spread of its windows how well that is known (`pooled_error`). A
mode switch or new split is checked against the tally of the configuration it left (`policy.check`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.policy.stats import MEMORY_WINDOWS

# A window's start may lie this far (seconds) before the time from which windows count and still
# count: it is read back as a difference of two clock readings (epoch seconds keep ~1e-7 s), and
# scrapes are whole seconds apart.
_EPS = 1e-3


@dataclass(frozen=True, slots=True)
class Tally:
    """Useful samples/s per window, summed over `windows` (decayed) windows with their squares."""

    windows: float = 0.0
    total: float = 0.0
    squares: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.windows if self.windows > 0 else 0.0

    @property
    def deviations(self) -> float:
        """The windows' summed squared deviations from their mean (never negative)."""
        if self.windows <= 0:
            return 0.0
        return max(0.0, self.squares - self.total * self.total / self.windows)

    def add(self, value: float) -> Tally:
        keep = 1.0 - 1.0 / MEMORY_WINDOWS
        return Tally(self.windows * keep + 1.0, self.total * keep + value, self.squares * keep + value * value)

    def to_list(self) -> list[float]:
        return [self.windows, self.total, self.squares]

    @classmethod
    def from_list(cls, data: Any) -> Tally:
        windows, total, squares = (finite(x) for x in data)
        if windows < 0 or total < 0 or squares < 0:
            raise ValueError("a progress tally's sums must be non-negative")
        return cls(windows, total, squares)


def pooled_error(a: Tally, b: Tally) -> float | None:
    """Standard error of `b.mean - a.mean` from the two tallies' pooled window spread (the two
    configurations run on the same fleet, so their windows share its noise); None while the pooled
    windows leave no spread to measure."""
    freedom = a.windows + b.windows - 2.0
    if a.windows <= 0 or b.windows <= 0 or freedom <= 0:
        return None
    variance = (a.deviations + b.deviations) / freedom
    return math.sqrt(variance * (1.0 / a.windows + 1.0 / b.windows))


@dataclass(frozen=True, slots=True)
class Progress:
    """`since`: windows that began at or after this time count (None: a change has not landed yet;
    the first evaluation it has landed by sets it); `tally`: what they measured; `speeds`: every
    rank's speed at the tally's first window, the fleet the tally measured (`check.fleet_drift`
    reads how far it moved since; empty before a window counts)."""

    since: float | None = 0.0
    tally: Tally = field(default_factory=Tally)
    speeds: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"since": self.since, "tally": self.tally.to_list(), "speeds": list(self.speeds)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Progress:
        if not data:
            return cls()
        since = data.get("since")
        return cls(
            None if since is None else finite(since),
            Tally.from_list(data.get("tally") or [0, 0, 0]),
            tuple(finite(s) for s in data.get("speeds") or ()),
        )


def restarted() -> Progress:
    """The progress of a configuration a change has just asked for: nothing counts before it lands."""
    return Progress(None, Tally())


def track(
    previous: Progress,
    scraped: float,
    starts: Mapping[int, float],
    world: int,
    useful: float | None,
    in_flight: bool,
    new_shape: bool,
    speeds: Sequence[float] = (),
) -> Progress:
    """The progress after this window. `scraped`: when this window's first sample was taken (where
    the next windows begin); `starts`: when each measured rank's window began (a rank measured from
    its training start left out); `useful`: the window's useful samples/s (None when it is no measure
    of the configuration: another mode still running somewhere, or a stale mode whose statistical
    efficiency is not measured in it yet); `speeds`: every rank's speed now, kept at the tally's
    first window. A change lands at the first evaluation that is not in
    flight; the window that ends there still ran into the change (a switch's pause), so only windows
    after it count."""
    if previous.since is None:
        return previous if in_flight else Progress(scraped, Tally())
    tally, first = (Tally(), ()) if new_shape else (previous.tally, previous.speeds)
    whole = len(starts) == world and all(t >= previous.since - _EPS for t in starts.values())
    if in_flight or not whole or useful is None or not math.isfinite(useful) or useful < 0:
        return Progress(previous.since, tally, first)
    return Progress(previous.since, tally.add(useful), first if tally.windows > 0 else tuple(speeds))


def finite(value: Any) -> float:
    """`value` as a float, or ValueError when it is not a finite number (a stored state's fields)."""
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{value!r} is not a finite number")
    return out
