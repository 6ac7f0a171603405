"""What the policy decides, as plain data with a reason: every shell logs, counts and records it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KEEP = "keep"
SWITCH_MODE = "switchMode"
REBALANCE = "rebalance"
REPLACE_WORKER = "replaceWorker"
RESCALE = "rescale"


@dataclass(frozen=True, slots=True)
class Keep:
    """Change nothing."""

    reason: str
    action: str = field(default=KEEP, init=False)

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class SwitchMode:
    """Move the job to `mode`. `groups` (global ranks) for hierarchical; `batch_sizes` when the
    new mode also needs per-rank batch sizes (a rebalanced sync, or speed-matched groups)."""

    mode: str
    reason: str
    groups: tuple[tuple[int, ...], ...] | None = None
    batch_sizes: Mapping[int, int] | None = None
    predicted_gain: float = 0.0
    action: str = field(default=SWITCH_MODE, init=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "action": self.action,
            "reason": self.reason,
            "mode": self.mode,
            "predictedGain": self.predicted_gain,
        }
        if self.groups is not None:
            out["groups"] = [list(g) for g in self.groups]
        if self.batch_sizes is not None:
            out["batchSizes"] = {str(r): b for r, b in sorted(self.batch_sizes.items())}
        return out


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Stay synchronous, give each rank the batch size in `batch_sizes` (every rank listed)."""

    batch_sizes: Mapping[int, int]
    reason: str
    predicted_gain: float = 0.0
    action: str = field(default=REBALANCE, init=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "reason": self.reason,
            "batchSizes": {str(r): b for r, b in sorted(self.batch_sizes.items())},
            "predictedGain": self.predicted_gain,
        }


@dataclass(frozen=True, slots=True)
class ReplaceWorker:
    """Replace the worker pod that runs `rank`; keep the job off `exclude_node` when the slowness
    is bound to that node (None: the node is not to blame, or unknown)."""

    rank: int
    reason: str
    pod: str | None = None
    exclude_node: str | None = None
    predicted_gain: float = 0.0
    hung: bool = False  # a recovery from a hang (policy.hang), not a speed decision
    action: str = field(default=REPLACE_WORKER, init=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "action": self.action,
            "reason": self.reason,
            "rank": self.rank,
            "pod": self.pod,
            "excludeNode": self.exclude_node,
            "predictedGain": self.predicted_gain,
        }
        if self.hung:
            out["hung"] = True
        return out


@dataclass(frozen=True, slots=True)
class Rescale:
    """Run `replicas` worker pods; `remove_ranks` names the ranks whose pods go first; keep the job
    off `exclude_node` when the slowness of the removed ranks is bound to their node."""

    replicas: int
    reason: str
    remove_ranks: tuple[int, ...] = ()
    predicted_gain: float = 0.0
    exclude_node: str | None = None
    action: str = field(default=RESCALE, init=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "action": self.action,
            "reason": self.reason,
            "replicas": self.replicas,
            "removeRanks": list(self.remove_ranks),
            "predictedGain": self.predicted_gain,
        }
        if self.exclude_node is not None:
            out["excludeNode"] = self.exclude_node
        return out


Decision = Keep | SwitchMode | Rebalance | ReplaceWorker | Rescale


def per_rank_text(values: Mapping[int, int] | Mapping[str, int]) -> str:
    """`rank0=40 rank1=40 rank2=16`: per-rank values as Events and logs print them, in rank order."""
    return " ".join(f"rank{r}={v}" for r, v in sorted(((int(r), v) for r, v in values.items())))
