"""Sharded parameter server for async SGD, hosted on threads inside the worker processes.

Placement: the flat parameter vector is cut into `async.shards` contiguous slices; shard j lives
on rank j*N // shards (shard 0 always on rank 0, the control owner) and is served by a thread of
that process over its own gloo process group, so shard traffic never shares a communicator with
the training collectives or with another shard. A worker pushes its gradient slice to every shard
(non-blocking sends, reply receives posted first so no cycle of blocking sends can form) and gets
each shard's fresh slice back; a shard co-located with the worker is applied in-process.

Staleness: a shard counts updates (its version). A gradient's staleness is the number of updates
other workers made since this worker last pulled, divided by N-1: "how many steps the average
other worker took meanwhile" (a 3x slower worker among equals sees about 3). The learning rate is
damped by the configured rule (1/(1+s) or 1/sqrt(1+s)), and each update is weighted by its share
of the world's batch (b / sum of batch sizes), so per sample the step size matches sync SGD. With a
bound (`async.staleness`), a gradient staler than the bound is discarded (not counted as useful
samples) and the worker just takes the fresh model: fast workers never wait for slow ones at all,
a slow worker pays for its own staleness. Classic clock-based SSP blocking would instead pin fast
workers to a persistent straggler's pace; this bound limits the same thing (how old an applied
gradient may be) without that. `staleness: null` applies everything (ASP).

End of an async phase: shard 0 raises `stop` when any worker's push completes step `steps`
(the job's steps are the fastest worker's, per TrainingConfig.steps); every worker stops at its
next reply. Control epochs travel the same way (rank 0's pending epoch in every shard-0 reply), and
so do a graceful stop (`interrupt`, raised by any worker's push flagged `stopping`) and checkpoint
requests (`checkpoint_request`: the step of the checkpoint every worker must write its part of).
The update is the job's own optimizer (SGD, Adam, AdamW, ...): each shard runs a copy over its slice
(optim.OptimizerTemplate), loaded with that slice of the workers' optimizer state on entry and
gathered back on exit (`gather_state`), so a switch never resets momentum or Adam's moments. The
learning rate follows the schedule by the pushing worker's step (`lr_factor`). Checkpoints:
`snapshot()` gives a host's shards (parameters, optimizer state, version) and `restore()` puts them
back after `load()` when a resumed job re-enters async mode.

Limits: each shard is one Python thread serialising its pushes (measured on the quickstart MLP,
4 processes on a loaded 2-core machine: about 3 ms per exchange for a remote worker, 0.4 ms for
the co-located one, so a few hundred pushes/s per shard; add shards to spread the load over ranks);
the host's worker shares its CPU and GIL with the shard threads; per step each worker moves
2 x (model size) over the network spread over `shards` hosts; tensors go through host memory
(gloo), so GPU models pay a device copy per exchange; at most 64 shards (config bound).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sgdjob_trainer.config import AsyncConfig, StalenessLr
from sgdjob_trainer.optim import (
    FlatState,
    OptimizerTemplate,
    async_momentum,
    flat_state,
    load_flat_state,
    set_lr,
    slice_state,
)
from sgdjob_trainer.runtime import COLLECTIVE_TIMEOUT

log = logging.getLogger("sgdjob_trainer.ps")

# Kinds of message a shard thread takes. TICKET, END and MEET serve the adaptation API's async
# (adapt/asynchronous.py), to shard 0 only: a rank's next samples from the data queue (split.Dispenser);
# a rank's end of training, which shard 0 then tells every worker as its `stop`; a rank's call for
# every rank to meet at its next step boundary (a checkpoint is due), told as `checkpoint`.
PUSH, STOP, TICKET, END, MEET = 1, 2, 3, 4, 5
# int64 words: [kind, step, batch, stopping] / [version, epoch, stop, staleness_milli, applied, interrupted, checkpoint]
HEADER, REPLY = 4, 7
# A ticket's answer: [epoch, first index, end index, the world's epoch, cursor, batch].
TICKET_WORDS = 6
TAG_PUSH, TAG_GRAD, TAG_REPLY, TAG_PARAMS, TAG_TICKET = 11, 12, 13, 14, 15
# A shard thread sits in an any-source receive for as long as the job runs in another mode.
IDLE_TIMEOUT = timedelta(days=30)


def damping(rule: StalenessLr, staleness: float) -> float:
    return rule.factor(staleness)


@dataclass(slots=True)
class Reply:
    version: int
    epoch: int
    stop: bool
    staleness: float
    applied: bool
    interrupted: bool = False
    checkpoint: int = 0


class Shard:
    """One slice [lo, hi) of the parameters and the job's optimizer over it (optim.OptimizerTemplate:
    the same class and group settings, its state the slice of the workers' state); every access
    under the lock."""

    def __init__(self, lo: int, hi: int, world_size: int, cfg: AsyncConfig, template: OptimizerTemplate) -> None:
        self.lock = threading.Lock()
        self.params = torch.zeros(hi - lo)
        self.opt, self.views = template.build(lo, hi, self.params)
        if isinstance(self.opt, torch.optim.SGD):
            for group in self.opt.param_groups:
                group["momentum"] = async_momentum(group["momentum"], world_size, cfg.momentum)
        bounds, at = [], 0
        for view in self.views:
            bounds.append((at, at + view.numel()))
            at += view.numel()
        self.bounds = bounds
        self.world_size = world_size
        self.cfg = cfg
        self.version = 0
        self.base = [0] * world_size
        self.lr_scale = 1.0
        self.total_batch = 1

    def load(self, params: torch.Tensor, lr_scale: float, total_batch: int, state: FlatState) -> None:
        """The slice of a consistent model and of its optimizer state (optim.slice_state)."""
        with self.lock:
            self.params.copy_(params.detach().to("cpu", torch.float32))  # in place: the views stay
            load_flat_state(self.opt, self.views, state)
            self.base = [self.version] * self.world_size
            self.lr_scale, self.total_batch = lr_scale, total_batch

    def apply(
        self, worker: int, grad: torch.Tensor, batch_size: int, out: torch.Tensor, lr_factor: float = 1.0
    ) -> Reply:
        """Apply (or discard) one worker's gradient and copy the fresh slice into `out`."""
        with self.lock:
            staleness = (self.version - self.base[worker]) / max(1, self.world_size - 1)
            applied = self.cfg.staleness is None or staleness <= self.cfg.staleness
            if applied:
                # Each push is its batch's share of a sync step: the rate x b / (sum of batches).
                factor = self.lr_scale * lr_factor * batch_size / self.total_batch
                set_lr(self.opt, factor * damping(self.cfg.staleness_lr, staleness))
                for view, (a, b) in zip(self.views, self.bounds, strict=True):
                    view.grad = grad[a:b]
                self.opt.step()
                self.version += 1
            self.base[worker] = self.version
            out.copy_(self.params)
            return Reply(self.version, 0, False, staleness, applied)

    def state(self) -> FlatState:
        with self.lock:
            return flat_state(self.opt, self.views)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"params": self.params.clone(), "state": flat_state(self.opt, self.views), "version": self.version}

    def restore(self, doc: dict[str, Any]) -> bool:
        """Optimizer state and version from a checkpoint of the same shard layout (the parameters
        came with the model). False when the layout differs."""
        with self.lock:
            state = doc.get("state")
            size = self.params.numel()
            if state is None or any(v.dim() > 0 and v.numel() != size for v in state.values()):
                return False
            load_flat_state(self.opt, self.views, state)
            self.version = int(doc["version"])
            self.base = [self.version] * self.world_size
            return True


class ParameterServer:
    """Made once per process (collectively: it creates one gloo group per shard), used whenever
    the job is in async mode, idle otherwise; `close()` (collective) stops its threads."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        numel: int,
        cfg: AsyncConfig,
        template: OptimizerTemplate,
        steps: int,
        control_epoch: Callable[[], int],
        ctl: dist.ProcessGroup | None,
        lr_factor: Callable[[int], float] = lambda step: 1.0,
    ) -> None:
        self.rank, self.world_size, self.steps = rank, world_size, steps
        self.control_epoch = control_epoch
        self.lr_factor = lr_factor
        self.interrupt = False  # rank 0: a graceful stop, told to every worker by shard 0
        # Rank 0, for a script's async: its data queue, (epoch, size) -> TICKET_WORDS words (set before load).
        self.dispense: Callable[[int, int], list[int]] | None = None
        self._ticket_lock = threading.Lock()
        self.checkpoint_request = 0  # rank 0: newest checkpoint step, told by shard 0
        count = max(1, min(cfg.shards, numel))
        cuts = [numel * j // count for j in range(count + 1)]
        self.bounds = [(cuts[j], cuts[j + 1]) for j in range(count)]
        self.hosts = [j * world_size // count for j in range(count)]
        distributed = world_size > 1
        self.groups: list[dist.ProcessGroup | None] = [
            dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if distributed else None for _ in range(count)
        ]
        # CPU (gloo) group over all ranks for loading and gathering shards, whatever the training backend is.
        self.ctl = ctl
        self.shards = {
            j: Shard(lo, hi, world_size, cfg, template)
            for j, (lo, hi) in enumerate(self.bounds)
            if self.hosts[j] == rank
        }
        if rank == 0 and isinstance(self.shards[0].opt, torch.optim.SGD):
            theirs, ours = template.groups[0].get("momentum", 0.0), self.shards[0].opt.param_groups[0]["momentum"]
            if theirs != ours:
                log.info(
                    "async: the parameter servers apply SGD momentum %g, the job's %g lowered for the momentum "
                    "%d workers' stale pushes add by themselves (training.async.momentum sets it)",
                    ours,
                    theirs,
                    world_size,
                )
        self.stop_flag = False
        self.threads = [
            threading.Thread(target=self._serve, args=(j,), name=f"sgdjob-ps-{j}", daemon=True)
            for j in self.shards
            if distributed
        ]
        for thread in self.threads:
            thread.start()

    # -- server side -------------------------------------------------------------------------------
    def _serve(self, j: int) -> None:
        shard, group = self.shards[j], self.groups[j]
        lo, hi = self.bounds[j]
        header = torch.zeros(HEADER, dtype=torch.int64)
        grad = torch.zeros(hi - lo)
        out = torch.zeros(hi - lo)
        try:
            while True:
                src = dist.recv(header, src=None, group=group, tag=TAG_PUSH)
                kind = int(header[0])
                if kind == STOP:
                    return
                if kind in (END, MEET):
                    self._note(kind, int(header[1]))
                    continue
                if kind == TICKET:
                    answer = torch.tensor(self._ticket(int(header[1]), int(header[2])), dtype=torch.int64)
                    dist.send(answer, dst=src, group=group, tag=TAG_TICKET)
                    continue
                dist.recv(grad, src=src, group=group, tag=TAG_GRAD)
                reply = self._apply(j, shard, src, grad, int(header[1]), int(header[2]), out, bool(header[3]))
                dist.send(_encode(reply), dst=src, group=group, tag=TAG_REPLY)
                dist.send(out, dst=src, group=group, tag=TAG_PARAMS)
        except Exception:
            # Workers would wait on this shard forever: fail the whole process instead, so
            # torchrun restarts the job (from its checkpoint) rather than leaving it hung.
            log.exception("parameter-server shard %d failed; exiting so torchrun restarts the workers", j)
            logging.shutdown()
            os._exit(1)

    def _apply(
        self,
        j: int,
        shard: Shard,
        worker: int,
        grad: torch.Tensor,
        step: int,
        batch: int,
        out: torch.Tensor,
        stopping: bool = False,
    ) -> Reply:
        reply = shard.apply(worker, grad, batch, out, self.lr_factor(step))
        if j == 0:
            if stopping:  # a worker got SIGTERM: shard 0 tells every worker at its next exchange
                self.interrupt = True
            if step + 1 >= self.steps:
                self.stop_flag = True
            reply.epoch, reply.stop = self.control_epoch(), self.stop_flag
            reply.interrupted, reply.checkpoint = self.interrupt, self.checkpoint_request
        return reply

    def _ticket(self, epoch: int, size: int) -> list[int]:
        with self._ticket_lock:
            if self.dispense is None:
                raise RuntimeError("a ticket asked of a parameter server without a data queue")
            return self.dispense(epoch, size)

    # -- worker side -------------------------------------------------------------------------------
    def ticket(self, epoch: int, size: int) -> list[int]:
        """This worker's next `size` samples of `epoch` from shard 0's data queue: its TICKET_WORDS words."""
        if 0 in self.shards:
            return self._ticket(epoch, size)
        group, host = self.groups[0], self.hosts[0]
        answer = torch.zeros(TICKET_WORDS, dtype=torch.int64)
        works = [_req(dist.irecv(answer, src=host, group=group, tag=TAG_TICKET))]
        header = torch.tensor([TICKET, epoch, size, 0], dtype=torch.int64)
        works.append(_req(dist.isend(header, dst=host, group=group, tag=TAG_PUSH)))
        for work in works:
            work.wait(COLLECTIVE_TIMEOUT)
        return [int(v) for v in answer.tolist()]

    def end(self) -> None:
        """This worker's training is over: shard 0 raises `stop` in every later reply."""
        self._tell(END, 0)

    def meet(self, mark: int) -> None:
        """Every worker is to meet at its next step boundary: shard 0 replies `checkpoint` >= `mark`."""
        self._tell(MEET, mark)

    def _tell(self, kind: int, word: int) -> None:
        if 0 in self.shards:
            self._note(kind, word)
        else:
            header = torch.tensor([kind, word, 0, 0], dtype=torch.int64)
            dist.send(header, dst=self.hosts[0], group=self.groups[0], tag=TAG_PUSH)

    def _note(self, kind: int, word: int) -> None:
        """Shard 0's host: an END or a MEET, told in every later reply."""
        if kind == END:
            self.stop_flag = True
        else:
            self.checkpoint_request = max(self.checkpoint_request, word)

    def exchange(self, grad: torch.Tensor, step: int, batch: int, out: torch.Tensor, stopping: bool = False) -> Reply:
        """Push this worker's flat gradient (CPU) to every shard; fill `out` with the fresh model."""
        works: list[dist.Work] = []
        keep: list[torch.Tensor] = []
        replies: list[torch.Tensor] = []
        for j, (lo, hi) in enumerate(self.bounds):
            host = self.hosts[j]
            if host == self.rank:
                continue
            reply = torch.zeros(REPLY, dtype=torch.int64)
            replies.append(reply)
            group = self.groups[j]
            # Receives first: a shard's reply send then always finds its receive posted.
            for tensor, tag in ((reply, TAG_REPLY), (out[lo:hi], TAG_PARAMS)):
                works.append(_req(dist.irecv(tensor, src=host, group=group, tag=tag)))
            header = torch.tensor([PUSH, step, batch, int(stopping)], dtype=torch.int64)
            payload = grad[lo:hi].contiguous()
            keep += [header, payload]
            for tensor, tag in ((header, TAG_PUSH), (payload, TAG_GRAD)):
                works.append(_req(dist.isend(tensor, dst=host, group=group, tag=tag)))
        local = [
            self._apply(j, shard, self.rank, grad[lo:hi], step, batch, out[lo:hi], stopping)
            for j, shard in self.shards.items()
            for lo, hi in [self.bounds[j]]
        ]
        for work in works:
            work.wait(COLLECTIVE_TIMEOUT)  # a lost shard host surfaces as an error, not a hang
        merged = local + [_decode(r) for r in replies]
        return Reply(
            version=max(r.version for r in merged),
            epoch=max(r.epoch for r in merged),
            stop=any(r.stop for r in merged),
            staleness=max(r.staleness for r in merged),
            applied=all(r.applied for r in merged),
            interrupted=any(r.interrupted for r in merged),
            checkpoint=max(r.checkpoint for r in merged),
        )

    # -- collective phases -------------------------------------------------------------------------
    def load(self, flat: torch.Tensor, lr_scale: float, total_batch: int, state: FlatState) -> None:
        """Collective: each host takes its slice of the (consistent) model and optimizer state; then
        a barrier, so no push reaches a shard before it is loaded."""
        cpu = flat.detach().to("cpu", torch.float32)
        for j, shard in self.shards.items():
            lo, hi = self.bounds[j]
            shard.load(cpu[lo:hi], lr_scale, total_batch, slice_state(state, lo, hi))
        self.stop_flag = False
        if self.ctl is not None:
            dist.barrier(group=self.ctl)

    def gather(self, numel: int) -> torch.Tensor:
        """Collective: the whole server model on every rank (each host broadcasts its slices)."""
        flat = torch.zeros(numel)
        for j, (lo, hi) in enumerate(self.bounds):
            if j in self.shards:
                flat[lo:hi] = self.shards[j].snapshot()["params"]
            if self.ctl is not None:
                dist.broadcast(flat[lo:hi], src=self.hosts[j], group=self.ctl)
        return flat

    def gather_state(self, numel: int) -> FlatState:
        """Collective: the shards' optimizer state, whole, on every rank (scalars: shard 0's)."""
        states = {j: shard.state() for j, shard in self.shards.items()}  # flattened once per shard
        hosted = {j: {k: v.dim() for k, v in state.items()} for j, state in states.items()}
        everyone: list[dict[int, dict[str, int]] | None] = [hosted]
        if self.ctl is not None:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, hosted, group=self.ctl)
        keys: dict[int, dict[str, int]] = {}
        for entry in everyone:
            keys.update(entry or {})
        out: FlatState = {}
        for j, (lo, hi) in enumerate(self.bounds):
            mine = states.get(j, {})
            for key, dim in sorted(keys.get(j, {}).items()):
                if dim == 0 and j > 0:
                    continue
                part = mine[key].to(torch.float32) if key in mine else torch.zeros(() if dim == 0 else hi - lo)
                if self.ctl is not None:
                    dist.broadcast(part, src=self.hosts[j], group=self.ctl)
                if dim == 0:
                    out[key] = part
                else:
                    out.setdefault(key, torch.zeros(numel))[lo:hi] = part
        return out

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """This rank's hosted shards, for its checkpoint part."""
        return {j: shard.snapshot() for j, shard in self.shards.items()}

    def restore(self, docs: dict[int, dict[str, Any]]) -> int:
        """After `load()`: optimizer state and versions of the hosted shards from a checkpoint; how many."""
        return sum(1 for j, shard in self.shards.items() if j in docs and shard.restore(docs[j]))

    def close(self) -> None:
        """Collective: the rank after each host sends that shard's thread a STOP (a thread cannot
        be woken from its receive by its own process)."""
        if self.world_size > 1:
            for j, host in enumerate(self.hosts):
                if (host + 1) % self.world_size == self.rank:
                    dist.send(
                        torch.tensor([STOP, 0, 0, 0], dtype=torch.int64), dst=host, group=self.groups[j], tag=TAG_PUSH
                    )
        for thread in self.threads:
            thread.join(timeout=30)


def _req(work: dist.Work | None) -> dist.Work:
    assert work is not None, "point-to-point operations always return a request"
    return work


def _encode(reply: Reply) -> torch.Tensor:
    words = [
        reply.version,
        reply.epoch,
        int(reply.stop),
        round(reply.staleness * 1000),
        int(reply.applied),
        int(reply.interrupted),
        reply.checkpoint,
    ]
    return torch.tensor(words, dtype=torch.int64)


def _decode(t: torch.Tensor) -> Reply:
    v = [int(x) for x in t.tolist()]
    return Reply(
        version=v[0],
        epoch=v[1],
        stop=bool(v[2]),
        staleness=v[3] / 1000,
        applied=bool(v[4]),
        interrupted=bool(v[5]),
        checkpoint=v[6],
    )
