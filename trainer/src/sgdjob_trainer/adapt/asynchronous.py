"""Async SGD for a script on the adaptation API: the trainer's parameter server (strategies/ps.py), with
the script's own model, optimizer and loop.

- The script's `optimizer.step()` becomes a push: while the session is in async, the optimizer's
  `step` is replaced on the instance (as torch's LR schedulers wrap it) by one that sends the rank's
  gradient to the shards and copies the model they send back into the parameters. The shards run the
  script's optimizer class over their slices, loaded with the model and its state on entry and
  gathered back into every rank's model and optimizer on the way out, so a switch keeps momentum and
  Adam's moments. The session's DDP hook (ddp.py) keeps each rank's gradient to itself: no allreduce.
- The data: the ranks draw their batches from one queue (split.Dispenser) that shard 0's host holds,
  so a fast rank takes more batches and every rank's epoch ends together (within a batch).
- The agreement rides the shards' replies, as in the trainer: rank 0's pending control epoch, a stop
  asked for on any rank, a rank's end of training, a rank's call to meet (a checkpoint is due). A rank
  that reads one of them at its step boundary meets the others there (session.py): the stay ends
  (every rank takes the server's model and state, and the queue's position), what was asked for is
  done in sync's terms, and a new stay begins if the job is still to run async.
- The learning rate: the shards apply each push at the rate of its batch's share of the global batch
  (as sync's average weighs it), times the staleness damping of training.async, times the ratio of
  the script's current learning rate (its first parameter group's, on shard 0's host) to the one at
  entry, so a scheduler the script steps still moves the shards' rate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from sgdjob_trainer.adapt.ddp import Exchange
from sgdjob_trainer.adapt.hierarchy import copy_into, trainable
from sgdjob_trainer.adapt.hierarchy import obstacle as shared_obstacle
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.split import Dispenser, Position, Split
from sgdjob_trainer.config import AsyncConfig
from sgdjob_trainer.optim import BASE_LR, OptimizerTemplate, async_obstacle, flat_state, load_flat_state
from sgdjob_trainer.strategies.ps import ParameterServer, Reply

log = logging.getLogger("sgdjob_trainer.adapt")

# A script's job has no step count of its own: the shards never end an async phase by steps.
NO_STEP_LIMIT = 2**62


def obstacle(
    model: DistributedDataParallel | None, optimizer: torch.optim.Optimizer | None, loader: AdaptiveLoader | None
) -> str | None:
    """Why this script cannot run async (None: it can)."""
    if loader is None:
        return "the script reads its data without session.loader(), and async hands out batches from one queue"
    why = shared_obstacle(model, optimizer)  # a model to keep out of the allreduce, an optimizer to shard
    if why is not None or model is None or optimizer is None:
        return why
    return async_obstacle(optimizer, trainable(model))


def make_server(
    rank: int,
    world: int,
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    config: AsyncConfig,
    control_epoch: Callable[[], int],
    ctl: torch.distributed.ProcessGroup | None,
) -> ParameterServer:
    """Collective (one gloo group per shard): the session's parameter server, made at its first async stay."""
    params = trainable(model)
    template = OptimizerTemplate(optimizer, params)
    for group in template.groups:
        group[BASE_LR] = float(group["lr"])
    first = template.groups[0][BASE_LR]

    def lr_factor(step: int) -> float:  # the script's schedule, as far as shard 0's host has stepped it
        return float(optimizer.param_groups[0]["lr"]) / first if first > 0 else 1.0

    numel = sum(p.numel() for p in params)
    return ParameterServer(rank, world, numel, config, template, NO_STEP_LIMIT, control_epoch, ctl, lr_factor)


class AsyncStay:
    """One stay in async: made at an agreed step on every rank (collective), ended by `leave()`."""

    def __init__(
        self,
        server: ParameterServer,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        exchange: Exchange,
        loader: AdaptiveLoader,
        split: Split,
        rank: int,
        step: Callable[[], int],
        stopping: Callable[[], bool],
    ) -> None:
        self.server, self.optimizer, self.exchange, self.loader = server, optimizer, exchange, loader
        self.params = trainable(model)
        self.numel = sum(p.numel() for p in self.params)
        self.rank, self.size = rank, split.size(rank)
        self._step, self._stopping = step, stopping
        self.reply = Reply(0, 0, False, 0.0, True)
        self.queue = Dispenser(loader.position, loader.samples, split.total) if rank == 0 else None
        if self.queue is not None:
            server.dispense = self.queue.words
        flat = torch.cat([p.detach().reshape(-1) for p in self.params]).to("cpu", torch.float32)
        server.load(flat, 1.0, split.total, flat_state(optimizer, self.params))  # ends in a barrier
        self.fresh = torch.zeros(self.numel)
        exchange.group = None  # each rank's gradient goes to the shards, not to an allreduce
        loader.among = (rank,)
        loader.dispense = lambda epoch, size: Dispenser.ticket(server.ticket(epoch, size))
        self._own_step = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, kept for after
        optimizer.step = self.push  # type: ignore[method-assign,assignment]

    def push(self, closure: Callable[[], float] | None = None) -> None:
        """The optimizer's step in async: this rank's gradient to the shards, their model back."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.detach().reshape(-1) for g in grads]).to("cpu", torch.float32)
        start = time.perf_counter()
        self.reply = self.server.exchange(flat, self._step(), self.size, self.fresh, self._stopping())
        self.exchange.add_wait(time.perf_counter() - start)  # the step's wait in its gradient exchange
        copy_into(self.params, self.fresh)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's wrapper notes

    def leave(self) -> Position | None:
        """Collective: every rank takes the server's model and optimizer state. On rank 0: the queue's
        position, where the world stands in the data (batches taken and not trained are skipped)."""
        copy_into(self.params, self.server.gather(self.numel))
        load_flat_state(self.optimizer, self.params, self.server.gather_state(self.numel))
        if self._own_step is None:
            del self.optimizer.step
        else:
            self.optimizer.step = self._own_step  # type: ignore[method-assign]
        self.exchange.group = self.exchange.world
        self.loader.among = None
        self.loader.dispense = None
        self.server.dispense = None
        return self.queue.position if self.queue is not None else None
