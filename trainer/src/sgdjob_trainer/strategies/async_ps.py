"""Asynchronous SGD against the sharded parameter server (see strategies/ps.py for the design).

Each step a worker computes a gradient on the model it last pulled, pushes it to every shard and
continues from the fresh model the shards send back: it never waits for another worker, only for
the shards' service time. Entering async loads the (consistent) model into the shards; leaving
gives every rank the server's model, so e.g. async -> sync starts every rank from it. The optimizer
state goes with the model both ways (ps.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.optim import async_obstacle, flat_state, load_flat_state
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
        ctx = self.ctx
        obstacle = async_obstacle(ctx.state.optimizer, self.params)
        if obstacle is not None:  # every rank has the same optimizer: all raise here together
            raise ValueError(f"async mode: {obstacle}")
        self.server.load(
            self.flat_params(), ctx.lr_scale, ctx.total_batch(), flat_state(ctx.state.optimizer, self.params)
        )
        if self.ctx.state.ps_shards:  # a resumed job: the shards' optimizer state and versions, once
            restored = self.server.restore(self.ctx.state.ps_shards)
            log.info("async: restored %d parameter-server shard(s) from the checkpoint", restored)
            self.ctx.state.ps_shards = {}
        self.fresh = torch.zeros(self.numel)
        cfg = self.ctx.training.async_
        bound = "unbounded (ASP)" if cfg.staleness is None else f"at most {cfg.staleness} steps"
        log.info(
            "async: %d parameter-server shard(s) on ranks %s, staleness %s, lr damping %s",
            len(self.server.hosts),
            self.server.hosts,
            bound,
            cfg.staleness_lr.value,
        )

    def step(self, offer: Callable[[], int]) -> StepResult:
        loss, compute, batch_size = self.compute_gradients()
        offered_epoch = offer()
        grad = self.flat_grads().to("cpu", torch.float32)
        if not self.ctx.state.scaler.unscale(grad):
            # fp16 overflow: skip this push (the scale has halved); the model stays as it is.
            return StepResult(loss=loss, samples=0, compute_s=compute, wait_s=0.0, seen_epoch=offered_epoch)
        # What a stale gradient is still worth, measured while async runs (gradient_stats module doc).
        self.ctx.grad_stats.observe_own(grad, batch_size)
        stopping = self.ctx.stopping.is_set()
        start = time.perf_counter()
        reply = self.server.exchange(grad, self.ctx.state.step, batch_size, self.fresh, stopping)
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
            # This worker's own stop has reached shard 0 with this push: it stops now, the
            # others at their next exchange, so no rank waits long in the switch barrier.
            interrupted=reply.interrupted or stopping,
            checkpoint=reply.checkpoint,
        )

    def leave(self) -> None:
        self.set_params(self.server.gather(self.numel).to(self.params[0].device))
        # The shards' optimizer state, so the next mode continues Adam's moments (or momentum).
        load_flat_state(self.ctx.state.optimizer, self.params, self.server.gather_state(self.numel))
