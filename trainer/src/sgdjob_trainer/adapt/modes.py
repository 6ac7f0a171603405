"""The session's mode, sync, hierarchical or async, and the switches between them (hierarchy.py and
asynchronous.py are the mechanisms). Every method that changes the mode is collective: the session
calls it at a step boundary every rank agreed on (a command's round, a meeting in async, a
checkpoint's step, the end), so every rank makes the same process groups and takes the same
averages in the same order.

In async a stay is paused at every meeting (asynchronous.py: the world meets for a command, a
checkpoint, a stop, the end): the ranks hold the server's model while the session does what the
meeting is for, and `resume()` starts a new stay if the mode is still async; a pause is no switch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from sgdjob_trainer.adapt import asynchronous
from sgdjob_trainer.adapt.asynchronous import AsyncStay
from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.adapt.ddp import Exchange
from sgdjob_trainer.adapt.hierarchy import Hierarchy, RoundOutcome, Subgroups, gather_groups, obstacle
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.split import Position, Split
from sgdjob_trainer.config import AsyncConfig, HierarchicalConfig, SyncMode
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.strategies.ps import ParameterServer
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
        async_config: AsyncConfig,
        session: AsyncHooks,
    ) -> None:
        self.info, self.comm, self.telemetry, self.config = info, comm, telemetry, config
        self.optimizer = optimizer
        self.async_config, self.hooks = async_config, session
        self.server: ParameterServer | None = None  # made at the first async stay (collective)
        self.async_refusal: str | None = None  # a framework integration that does not run async says why
        self.stay: AsyncStay | None = None
        self.mode = SyncMode.SYNC
        self.model: DistributedDataParallel | None = None
        self.exchange: Exchange | None = None
        self.loader: AdaptiveLoader | None = None
        self.hierarchy: Hierarchy | None = None
        self.subgroups = Subgroups()
        telemetry.hierarchical_capable = False  # until attach() has a model to regroup
        telemetry.async_capable = False  # until attach() and the loader give it a model and data to queue

    @property
    def hierarchical(self) -> bool:
        return self.hierarchy is not None

    @property
    def groups(self) -> list[list[int]] | None:
        return self.hierarchy.groups if self.hierarchy is not None else None

    @property
    def asynchronous(self) -> bool:
        return self.mode == SyncMode.ASYNC

    def attach(self, model: DistributedDataParallel, exchange: Exchange) -> None:
        self.model, self.exchange = model, exchange
        self.telemetry.hierarchical_capable = obstacle(model, self.optimizer) is None
        self.note_async()

    def set_loader(self, loader: AdaptiveLoader) -> None:
        self.loader = loader
        self._regroup_loader()
        self.note_async()

    def _async_why(self) -> str | None:
        return self.async_refusal or asynchronous.obstacle(self.model, self.optimizer, self.loader)

    def note_async(self) -> None:
        self.telemetry.async_capable = self._async_why() is None

    def async_obstacle(self) -> str | None:
        """Collective: why this rank, or another, cannot run async."""
        why = self._async_why()
        able = self.comm.all_min(int(why is None))
        self.telemetry.async_capable = bool(able)
        return why if why is not None or able else "another rank cannot run async (its log says why)"

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
        """The staleness the policy reads: steps since the last model average (hierarchical), the last
        push's staleness (async)."""
        if self.stay is not None:
            return self.stay.reply.staleness
        return float(self.hierarchy.age()) if self.hierarchy is not None else 0.0

    def discarded(self) -> bool:
        """In async: the last push was staler than training.async.staleness and not applied."""
        return self.stay is not None and not self.stay.reply.applied

    def merge(self) -> None:
        if self.hierarchy is not None:
            self.hierarchy.merge()

    def switch(self, mode: SyncMode, given: list[list[int]] | None, reason: str, step: int) -> None:
        """Collective: into hierarchical (or to new groups), or back to sync. `mode` is one
        `obstacle()` allowed (split.apply_command)."""
        if mode == SyncMode.SYNC:
            self.leave(reason, step)
            return
        if mode == SyncMode.ASYNC:
            self._to_async(reason, step)
            return
        if self.asynchronous:
            self.leave(f"to hierarchical: {reason}", step)
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
        self.mode = SyncMode.HIERARCHICAL
        self.telemetry.record_switch(SyncMode.SYNC, mode, step, time.perf_counter() - start, reason)
        log.info("hierarchical at step %d: groups %s (%s)", step, groups, reason)

    def _to_async(self, reason: str, step: int) -> None:
        if self.asynchronous:
            return
        if self.hierarchy is not None:
            self.leave(f"to async: {reason}", step)
        start = time.perf_counter()
        self.mode = SyncMode.ASYNC
        self.resume()
        self.telemetry.record_switch(SyncMode.SYNC, SyncMode.ASYNC, step, time.perf_counter() - start, reason)
        log.info("async at step %d: %s", step, reason)

    def resume(self) -> None:
        """Collective: a new async stay from the model every rank holds (the mode is async, no stay runs)."""
        if not self.asynchronous or self.stay is not None:
            return
        assert self.model is not None and self.optimizer is not None and self.exchange is not None  # obstacle()
        assert self.loader is not None
        if self.server is None:
            self.server = asynchronous.make_server(
                self.info.rank,
                self.info.world_size,
                self.model,
                self.optimizer,
                self.async_config,
                self.hooks.control_epoch,
                self.comm.group,
            )
        split = self.hooks.split()
        self.loader.relocate(self.loader.position, split)  # batches cut ahead in sync are not taken twice
        self.stay = AsyncStay(
            self.server,
            self.model,
            self.optimizer,
            self.exchange,
            self.loader,
            split,
            self.info.rank,
            self.hooks.step,
            self.hooks.stopping,
        )

    def pause(self) -> None:
        """Collective: the stay ends, every rank holds the server's model and state and stands at the
        queue's position; the mode stays async (no-op outside a stay)."""
        if self.stay is None:
            return
        mine = self.stay.leave()
        self.stay = None
        doc = self.comm.broadcast(mine.as_dict() if mine is not None else None)
        assert self.loader is not None and doc is not None  # rank 0 holds the queue
        self.loader.relocate(Position.from_dict(doc), self.hooks.split())

    def leave(self, reason: str, step: int) -> None:
        """Collective: back to sync, every rank with the mean (hierarchical) or the server's (async) model
        and optimizer state (no-op in sync)."""
        if self.mode == SyncMode.SYNC:
            return
        start = time.perf_counter()
        left = self.mode
        if self.hierarchy is not None:
            self.hierarchy.leave()
            self.hierarchy = None
            self._regroup_loader()
        self.pause()
        self.mode = SyncMode.SYNC
        pause = time.perf_counter() - start
        self.telemetry.record_switch(left, SyncMode.SYNC, step, pause, reason)
        log.info("sync at step %d from %s: every rank holds one model and optimizer state (%s)", step, left, reason)

    def close(self) -> None:
        """Collective, at the end: the parameter server's threads stop (no-op if async never ran)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def _regroup_loader(self) -> None:
        """The loader weighs each batch's gradient among the ranks it is averaged with."""
        if self.loader is not None:
            self.loader.among = tuple(self.hierarchy.my_group) if self.hierarchy is not None else None


class AsyncHooks:
    """What an async stay reads of its session: the step (for the learning-rate schedule), whether a stop
    is asked for (told to every rank through shard 0), rank 0's pending control epoch, the split."""

    def __init__(
        self,
        step: Callable[[], int],
        stopping: Callable[[], bool],
        control_epoch: Callable[[], int],
        split: Callable[[], Split],
    ) -> None:
        self.step, self.stopping, self.control_epoch, self.split = step, stopping, control_epoch, split
