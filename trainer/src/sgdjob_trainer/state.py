"""TrainState: everything a restart must recover, in one place.

The checkpoint work (save/load, elastic resume) builds on `state_dict()` / `load_state_dict()`:
model, optimizer, step, data position, mode, control epoch, per-rank batch sizes, groups, the
hosted parameter-server shards and the random-number streams. Metrics are not state: they are
cumulative per process and restart from zero with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.data import DataPosition


@dataclass(slots=True)
class TrainState:
    model: nn.Module
    optimizer: torch.optim.SGD
    mode: SyncMode
    step: int = 0
    control_epoch: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    groups: list[list[int]] | None = None
    data: DataPosition = field(default_factory=DataPosition)
    jitter_rng: random.Random = field(default_factory=random.Random)
    # Shard index -> {"params", "momentum", "version"} for the parameter-server shards this rank
    # hosts; filled by the async strategy's server when it snapshots (see ParameterServer.state).
    ps_shards: dict[int, dict[str, Any]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "mode": self.mode.value,
            "step": self.step,
            "control_epoch": self.control_epoch,
            "batch_sizes": dict(self.batch_sizes),
            "groups": self.groups,
            "data": {"epoch": self.data.epoch, "offset": self.data.offset},
            "jitter_rng": self.jitter_rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "ps_shards": self.ps_shards,
        }

    def load_state_dict(self, doc: dict[str, Any]) -> None:
        self.model.load_state_dict(doc["model"])
        self.optimizer.load_state_dict(doc["optimizer"])
        self.mode = SyncMode(doc["mode"])
        self.step = int(doc["step"])
        self.control_epoch = int(doc["control_epoch"])
        self.batch_sizes = {int(k): int(v) for k, v in doc["batch_sizes"].items()}
        self.groups = doc["groups"]
        self.data.epoch, self.data.offset = int(doc["data"]["epoch"]), int(doc["data"]["offset"])
        self.jitter_rng.setstate(doc["jitter_rng"])
        torch.set_rng_state(doc["torch_rng"])
        self.ps_shards = doc["ps_shards"]
