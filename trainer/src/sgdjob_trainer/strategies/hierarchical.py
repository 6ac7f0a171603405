"""Hierarchical SGD: synchronous inside a group, delayed model averaging across groups.

Inside a group (by node by default, by measured speed, or explicit groups from the config or the
controller) gradients are allreduced every step, so a group's members always hold the same model.
Across groups the whole model is averaged every `averageEvery` steps with a bounded delay: at each
round boundary a rank snapshots its parameters and starts a non-blocking allreduce of them over the
world, and consumes the result `staleness` rounds later by applying
`params += (average - snapshot) / (1 + staleness)`, keeping its own progress since the snapshot.
The damping matters: a full correction that is s rounds old drives the groups' disagreement d by
d[t+1] = d[t] - d[t-s], which oscillates and grows for s >= 2 (spectral radius 1.15 at s=2, and
the run diverges); with 1/(1+s) the radius stays below 1 (0.84 at s=2, 0.96 at s=8). A round's
allreduce completes only when every group reached that round, so a fast group runs at most
`staleness` rounds ahead of the slowest and then waits; a slow group never stalls a fast one
beyond that bound. staleness 0 is plain periodic model averaging.

Optimizer state: each group's ranks step the same optimizer on the same gradients, so a group holds
one state, its own (the cross-group average moves parameters only); leaving hierarchical averages
the state over all ranks, so the next mode starts from one state (optim.average_state).

Control: rank 0 adds its pending command epoch to each round's buffer; a round is consumed at the
same step number by every rank (round r at boundary r + staleness), so all ranks see the epoch
at the same step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from sgdjob_trainer.config import GroupBy, SyncMode
from sgdjob_trainer.optim import average_state
from sgdjob_trainer.strategies.base import StepResult, Strategy

log = logging.getLogger("sgdjob_trainer.hierarchical")
# Two ranks belong to different speed groups when the faster is this many times faster.
SPEED_GROUP_RATIO = 1.5


def valid_groups(groups: list[list[int]] | None, world_size: int) -> bool:
    if not groups:
        return False
    flat = sorted(r for g in groups for r in g)
    return flat == list(range(world_size))


def group_by_speed(speeds: list[float]) -> list[list[int]]:
    """Sort ranks by speed and cut wherever the next rank is SPEED_GROUP_RATIO times slower."""
    order = sorted(range(len(speeds)), key=lambda r: -speeds[r])
    groups: list[list[int]] = [[order[0]]]
    for prev, rank in itertools.pairwise(order):
        if speeds[rank] * SPEED_GROUP_RATIO < speeds[prev]:
            groups.append([])
        groups[-1].append(rank)
    return sorted(sorted(g) for g in groups)


def group_by_node(nodes: list[str]) -> list[list[int]]:
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    return sorted(by_node.values())


class HierarchicalStrategy(Strategy):
    mode = SyncMode.HIERARCHICAL

    def enter(self) -> None:
        ctx = self.ctx
        cfg = ctx.training.hierarchical
        self.every = cfg.average_every
        self.staleness = cfg.staleness
        # Measured groupings are not stored in the state: a later entry (or a resume) measures again.
        self.groups = self._resolve_groups()
        self.my_group = next(g for g in self.groups if ctx.info.rank in g)
        self.group_pg: dist.ProcessGroup | None = None
        # new_group is collective over the world: every rank creates every group, in one order.
        for group in self.groups:
            if len(group) < 2 or len(group) == ctx.info.world_size:
                continue
            key = tuple(group)
            if key not in ctx.group_cache:
                ctx.group_cache[key] = dist.new_group(ranks=list(group))
            if ctx.info.rank in group:
                self.group_pg = ctx.group_cache[key]
        log.info(
            "hierarchical: groups %s, model average every %d steps, at most %d rounds behind",
            self.groups,
            self.every,
            self.staleness,
        )
        self.local_steps = 0
        self.outstanding: deque[tuple[dist.Work, torch.Tensor, torch.Tensor]] = deque()

    def _resolve_groups(self) -> list[list[int]]:
        ctx = self.ctx
        world = ctx.info.world_size
        for candidate in (ctx.state.groups, ctx.training.hierarchical.groups):
            if valid_groups(candidate, world):
                return [sorted(g) for g in candidate or []]
        if ctx.training.hierarchical.group_by == GroupBy.SPEED:
            speeds: list[float] = [0.0] * world
            dist.all_gather_object(speeds, ctx.telemetry.summary()["speedSamplesPerS"])
            if all(s > 0 for s in speeds):
                return group_by_speed(speeds)
        nodes: list[str] = [""] * world
        dist.all_gather_object(nodes, ctx.info.node)
        return group_by_node(nodes)

    def step(self, offer: Callable[[], int]) -> StepResult:
        ctx = self.ctx
        loss, compute, samples = self.compute_gradients()
        wait, finite = 0.0, True
        if len(self.my_group) > 1:
            wait, _, _, finite = self.weighted_allreduce(self.group_pg, samples)
        else:
            grad = self.flat_grads()
            finite = ctx.state.scaler.unscale(grad)
            if finite:  # alone in its group: its own consecutive gradients (gradient_stats module doc)
                ctx.grad_stats.observe_own(grad, samples)
            self.set_grads(grad)
        compute += self.optimizer_step(finite)
        self.local_steps += 1
        seen, stopping = 0, False
        if self.local_steps % self.every == 0:
            snapshot = self.flat_params()
            # A stop travels with the round like the epoch: consumed at the same step everywhere.
            tail = torch.tensor(
                [float(offer()), 1.0 if ctx.stopping.is_set() else 0.0],
                device=snapshot.device,
                dtype=snapshot.dtype,
            )
            buf = torch.cat([snapshot / ctx.info.world_size, tail])
            work = dist.all_reduce(buf, async_op=True)
            assert work is not None
            self.outstanding.append((work, buf, snapshot))
            while len(self.outstanding) > self.staleness:
                waited, epoch, stop = self._consume()
                wait += waited
                seen = max(seen, epoch)
                stopping = stopping or stop
        age = len(self.outstanding) * self.every + self.local_steps % self.every
        return StepResult(
            loss=loss,
            samples=samples if finite else 0,
            compute_s=compute,
            wait_s=wait,
            staleness=float(age),
            seen_epoch=seen,
            interrupted=stopping,
        )

    def checkpoint_weight(self) -> int:
        """Each group's lowest rank saves the group's model, weighted by the group's size."""
        return len(self.my_group) if self.ctx.info.rank == min(self.my_group) else 0

    def _consume(self) -> tuple[float, int, bool]:
        work, buf, snapshot = self.outstanding.popleft()
        start = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - start
        self.set_params(self.flat_params() + (buf[: self.numel] - snapshot) / (1 + self.staleness))
        self.ctx.grad_stats.interrupt()  # the next gradient is at parameters that jumped
        return waited, round(float(buf[self.numel])), float(buf[self.numel + 1]) > 0

    def leave(self) -> None:
        # Every rank is at the same step, so every launched round has all its participants.
        while self.outstanding:
            self.outstanding.popleft()[0].wait()
        flat = self.flat_params() / self.ctx.info.world_size
        dist.all_reduce(flat)
        self.set_params(flat)
        # Each group ran its own copy of the optimizer; the next mode starts from their mean.
        average_state(self.ctx.state.optimizer, self.params)
