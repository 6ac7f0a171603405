"""Asynchronous SGD against the sharded parameter server (see strategies/ps.py for the design).

Each step a worker computes a gradient on the model it last pulled, pushes it to every shard and
continues from the fresh model the shards send back: it never waits for another worker, only for
the shards' service time. Entering async loads the (consistent) model into the shards; leaving
gives every rank the server's model, so e.g. async -> sync starts every rank from it.
"""

from __future__ import annotations

import logging
import time

import torch

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.strategies.base import StepResult, Strategy
from sgdjob_trainer.strategies.ps import ParameterServer

log = logging.getLogger("sgdjob_trainer.async")


class AsyncStrategy(Strategy):
    mode = SyncMode.ASYNC

    @property
    def server(self) -> ParameterServer:
        assert self.ctx.ps is not None, "the Trainer makes the parameter server before any strategy"
        return self.ctx.ps

    def enter(self) -> None:
        self.server.load(self.flat_params(), self.ctx.lr, self.ctx.total_batch())
        self.fresh = torch.zeros(self.numel)
        cfg = self.ctx.training.async_
        bound = "unbounded (ASP)" if cfg.staleness is None else f"at most {cfg.staleness} steps"
        log.info("async: %d parameter-server shard(s) on ranks %s, staleness %s, lr damping %s", len(self.server.hosts), self.server.hosts, bound, cfg.staleness_lr.value)
        self.reset_optimizer()

    def step(self, offered_epoch: int) -> StepResult:
        loss, compute, batch_size = self.compute_gradients()
        grad = self.flat_grads().to("cpu", torch.float32)
        start = time.perf_counter()
        reply = self.server.exchange(grad, self.ctx.state.step, batch_size, self.fresh)
        self.set_params(self.fresh.to(self.params[0].device))
        wait = time.perf_counter() - start
        return StepResult(
            loss=loss,
            samples=batch_size if reply.applied else 0,
            compute_s=compute,
            wait_s=wait,
            staleness=reply.staleness,
            seen_epoch=max(reply.epoch, offered_epoch),
            stop=reply.stop,
        )

    def leave(self) -> None:
        self.set_params(self.server.gather(self.numel).to(self.params[0].device))
        self.ctx.state.ps_shards = self.server.snapshot()
        self.reset_optimizer()
