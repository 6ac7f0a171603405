"""What the policy keeps of a change it checks by its results, and of a change it took back.

Plain data with its JSON form, kept in `PolicyState` (so an operator restart resumes the check).
The check itself is `policy.check`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sgdjob_operator.policy.progress import Tally, finite


@dataclass(frozen=True, slots=True)
class Trial:
    """A mode switch or new split under check. `key`/`label`: the candidate's (persistence and
    discounts name the key, reasons the label); `mode`: the mode it runs (a job found in another one
    is no longer running it); `predicted`: its
    predicted useful samples/s and `gain` that over the configuration it left, as the cost model saw
    both; `time`, `step`: when it was made; `shape`: the fleet's shape key then (on another fleet
    the comparison means nothing); `before`: the left configuration's measured progress; `back_*`:
    that configuration, to return to (every rank's batch, and groups where it ran hierarchical);
    `speeds`: every rank's speed at the left configuration's first measured window (the fleet
    `before` measured)."""

    key: str
    label: str
    mode: str
    predicted: float
    gain: float
    time: float
    step: int
    shape: str
    before: Tally
    back_mode: str
    back_batches: tuple[int, ...]
    back_groups: tuple[tuple[int, ...], ...] | None = None
    speeds: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "mode": self.mode,
            "predicted": self.predicted,
            "gain": self.gain,
            "time": self.time,
            "step": self.step,
            "shape": self.shape,
            "before": self.before.to_list(),
            "backMode": self.back_mode,
            "backBatches": list(self.back_batches),
            "backGroups": None if self.back_groups is None else [list(g) for g in self.back_groups],
            "speeds": list(self.speeds),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Trial | None:
        if not data:
            return None
        groups = data.get("backGroups")
        return cls(
            key=str(data["key"]),
            label=str(data["label"]),
            mode=str(data["mode"]),
            predicted=finite(data["predicted"]),
            gain=finite(data["gain"]),
            time=finite(data["time"]),
            step=int(data["step"]),
            shape=str(data["shape"]),
            before=Tally.from_list(data["before"]),
            back_mode=str(data["backMode"]),
            back_batches=tuple(int(b) for b in data["backBatches"]),
            back_groups=None if groups is None else tuple(tuple(int(r) for r in g) for g in groups),
            speeds=tuple(finite(s) for s in data.get("speeds") or ()),
        )


@dataclass(frozen=True, slots=True)
class Discount:
    """A change taken back for under-delivering: until `until`, and while the fleet keeps the shape it
    was measured on, the candidate `key` counts at `ratio` (what it delivered over what it was
    predicted to). `count`: how many times in a row it was taken back (each doubles the time)."""

    key: str
    shape: str
    ratio: float
    since: float
    until: float
    count: int = 1

    def active(self, shape: str, now: float) -> bool:
        return self.shape == shape and now < self.until

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "shape": self.shape,
            "ratio": self.ratio,
            "since": self.since,
            "until": self.until,
            "count": self.count,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Discount:
        out = cls(
            str(data["key"]),
            str(data["shape"]),
            finite(data["ratio"]),
            finite(data["since"]),
            finite(data["until"]),
            int(data.get("count", 1)),
        )
        if not 0.0 <= out.ratio <= 1.0 or out.until < out.since or out.count < 1:
            raise ValueError("a discount needs a ratio within [0, 1], an end after its start and a count of 1+")
        return out
