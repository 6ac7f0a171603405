"""TrainState: everything a restart must recover, in one place.

A checkpoint (see checkpoint.py) stores it in three shares, because the ranks hold different parts:
- `meta_fields()`: job-wide facts every rank agrees on (mode, control epoch, per-rank batch sizes,
  groups), written once by rank 0 into meta.json, with the step;
- `model_part(weight)`: model and optimizer, written by the ranks that own a model in the active
  mode (weight = how many ranks that model stands for);
- `rank_part()`: this rank's random-number streams, loss-scaler state and the parameter-server
  shards it hosts. Its data position goes into the checkpoint's sidecar, so every rank of a new
  world can re-shard from all old positions (data.rebase).
Metrics are not state: they are cumulative per process and restart from zero with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.data import DataPosition
from sgdjob_trainer.levers import LossScaler


@dataclass(slots=True)
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    mode: SyncMode
    step: int = 0
    control_epoch: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    groups: list[list[int]] | None = None
    data: DataPosition = field(default_factory=DataPosition)
    jitter_rng: random.Random = field(default_factory=random.Random)
    scaler: LossScaler = field(default_factory=lambda: LossScaler(False))
    # Shard index -> {"params", "state", "version"}: parameter-server shards loaded from a
    # checkpoint, consumed (restored into the shards) by the next entry into async mode.
    ps_shards: dict[int, dict[str, Any]] = field(default_factory=dict)

    def meta_fields(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "control_epoch": self.control_epoch,
            "batch_sizes": {str(k): v for k, v in self.batch_sizes.items()},
            "groups": self.groups,
        }

    def model_part(self, weight: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "weight": weight}

    def rank_part(self, ps_shards: dict[int, dict[str, Any]]) -> dict[str, Any]:
        return {
            "jitter_rng": self.jitter_rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "scaler": self.scaler.state_dict(),
            "ps_shards": ps_shards,
        }

    def load_meta(self, meta: dict[str, Any], world_size: int) -> None:
        self.mode = SyncMode(meta["mode"])
        self.step = int(meta["step"])
        self.control_epoch = int(meta["control_epoch"])
        # A smaller world drops the batch sizes of ranks it no longer has.
        self.batch_sizes = {int(k): int(v) for k, v in meta["batch_sizes"].items() if int(k) < world_size}
        groups = meta["groups"]
        flat = sorted(r for g in groups for r in g) if groups else None
        self.groups = groups if flat == list(range(world_size)) else None

    def load_rank_part(self, part: dict[str, Any]) -> None:
        self.jitter_rng.setstate(part["jitter_rng"])
        torch.set_rng_state(part["torch_rng"])
        self.scaler.load_state_dict(part["scaler"])
        self.ps_shards = {int(k): v for k, v in part["ps_shards"].items()}
