"""The session's mode, sync or hierarchical, and the switches between them (hierarchy.py is the
mechanism). Every method that changes the mode is collective: the session calls it at a step
boundary every rank agreed on (a command's round, a checkpoint's step, the end), so every rank
makes the same process groups and takes the same averages in the same order."""

from __future__ import annotations

import logging
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.adapt.ddp import Exchange
from sgdjob_trainer.adapt.hierarchy import Hierarchy, RoundOutcome, Subgroups, gather_groups, obstacle
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.config import HierarchicalConfig, SyncMode
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.telemetry import Telemetry

log = logging.getLogger("sgdjob_trainer.adapt")


class Modes:
    def __init__(
        self,
        info: WorldInfo,
        comm: Comm,
        telemetry: Telemetry,
        config: HierarchicalConfig,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.info, self.comm, self.telemetry, self.config = info, comm, telemetry, config
        self.optimizer = optimizer
        self.model: DistributedDataParallel | None = None
        self.exchange: Exchange | None = None
        self.loader: AdaptiveLoader | None = None
        self.hierarchy: Hierarchy | None = None
        self.subgroups = Subgroups()
        telemetry.hierarchical_capable = False  # until attach() has a model to regroup

    @property
    def hierarchical(self) -> bool:
        return self.hierarchy is not None

    @property
    def groups(self) -> list[list[int]] | None:
        return self.hierarchy.groups if self.hierarchy is not None else None

    def attach(self, model: DistributedDataParallel, exchange: Exchange) -> None:
        self.model, self.exchange = model, exchange
        self.telemetry.hierarchical_capable = obstacle(model, self.optimizer) is None

    def set_loader(self, loader: AdaptiveLoader) -> None:
        self.loader = loader
        self._regroup_loader()

    def obstacle(self) -> str | None:
        """Collective: why this rank, or another, cannot run hierarchical (every rank must enter it)."""
        why = obstacle(self.model, self.optimizer)
        able = self.comm.all_min(int(why is None))
        self.telemetry.hierarchical_capable = bool(able)
        return why if why is not None or able else "another rank cannot run hierarchical (its log says why)"

    def round(self, offer: int, stopping: bool) -> RoundOutcome:
        """In hierarchical, this step's share of the cross-group rounds, which carry the agreement."""
        return self.hierarchy.after_step(offer, stopping) if self.hierarchy is not None else RoundOutcome()

    def age(self) -> float:
        return float(self.hierarchy.age()) if self.hierarchy is not None else 0.0

    def merge(self) -> None:
        if self.hierarchy is not None:
            self.hierarchy.merge()

    def switch(self, mode: SyncMode, given: list[list[int]] | None, reason: str, step: int) -> None:
        """Collective: into hierarchical (or to new groups), or back to sync. `mode` is one
        `obstacle()` allowed (split.apply_command)."""
        if mode == SyncMode.SYNC:
            self.leave(reason, step)
            return
        speed = float(self.telemetry.summary()["speedSamplesPerS"])
        groups = gather_groups(self.comm, self.info.node, speed, given, self.config)
        if self.hierarchy is not None:
            if groups == self.hierarchy.groups:
                return
            self.leave(f"regrouped: {reason}", step)
        start = time.perf_counter()
        assert self.model is not None and self.exchange is not None and self.optimizer is not None  # obstacle()
        self.hierarchy = Hierarchy(self.model, self.optimizer, self.exchange, groups, self.config, self.subgroups)
        self._regroup_loader()
        self.telemetry.record_switch(SyncMode.SYNC, mode, step, time.perf_counter() - start, reason)
        log.info("hierarchical at step %d: groups %s (%s)", step, groups, reason)

    def leave(self, reason: str, step: int) -> None:
        """Collective: back to sync, every rank with the mean model and optimizer state (no-op in sync)."""
        if self.hierarchy is None:
            return
        start = time.perf_counter()
        self.hierarchy.leave()
        self.hierarchy = None
        self._regroup_loader()
        pause = time.perf_counter() - start
        self.telemetry.record_switch(SyncMode.HIERARCHICAL, SyncMode.SYNC, step, pause, reason)
        log.info("sync at step %d: every rank's model and optimizer state averaged (%s)", step, reason)

    def _regroup_loader(self) -> None:
        """The loader weighs each batch's gradient among the ranks it is averaged with."""
        if self.loader is not None:
            self.loader.among = tuple(self.hierarchy.my_group) if self.hierarchy is not None else None
