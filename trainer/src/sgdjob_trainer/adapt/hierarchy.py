"""Hierarchical SGD for a script on the adaptation API: the trainer's scheme
(strategies/hierarchical.py), with the script's own model, optimizer and loop.

- Inside a group (a control command's groups, else the job's training.hierarchical: explicit groups,
  by measured speed, by node) the session's DDP hook allreduces the split-weighted gradients over a
  subgroup instead of the world, so a group's ranks step the same model and never wait for another
  group's backward pass. torch's post_localSGD_hook does the same switch of DDP's group, but it has
  neither the split's weights nor the wait timing the policy reads, so the session's own hook
  (ddp.py) switches its group instead.
- Across groups, every `averageEvery` steps each rank snapshots its parameters and starts a
  non-blocking allreduce of them over the world; `staleness` rounds later it applies
  `params += (average - snapshot) / (1 + staleness)`, keeping its progress since the snapshot: the
  trainer's delayed, damped average (its module docstring says why the damping), each rank counting
  alike, so a group weighs as many ranks as it has. torch's model averagers (PeriodicModelAverager)
  average at once and in a blocking call, which would make the fast group wait for the slow one at
  every round.
- The step agreement rides those rounds: rank 0's pending control epoch and a stop asked for travel
  in the round's buffer, consumed at the same step on every rank, so no world collective runs at
  the steps between rounds. A fast group runs at most `staleness` rounds ahead of the slowest.
- `merge()` ends the groups' drift: the outstanding rounds are waited for (every rank is at the
  same step, so each has all its participants) and dropped, and every rank takes the exact mean of
  all ranks' parameters and optimizer state (optim.average_state): leaving hierarchical, and before a
  checkpoint, so the checkpoint holds the merged model a sync world continues from.

The rounds run on a world group of their own, made once, so the script's own collectives on the
default group never interleave with a round in flight.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector

from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.adapt.ddp import Exchange
from sgdjob_trainer.config import GroupBy, HierarchicalConfig
from sgdjob_trainer.optim import average_state, flat_state
from sgdjob_trainer.strategies.hierarchical import group_by_node, group_by_speed, valid_groups

log = logging.getLogger("sgdjob_trainer.adapt")


def obstacle(model: DistributedDataParallel | None, optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why this script cannot run hierarchical (None: it can)."""
    if model is None:
        return "adapt.start was given no DistributedDataParallel model, whose gradient exchange it must regroup"
    if optimizer is None:
        return (
            "adapt.start(optimizer=...) was not given: leaving hierarchical averages the optimizer's state "
            "over all ranks, as the trainer does, and the session has no optimizer to average"
        )
    try:  # averaging it needs elementwise state (optim.flat_state says which is not)
        flat_state(optimizer, trainable(model))
    except ValueError as err:
        return f"its optimizer's state cannot be averaged over the ranks: {err}"
    if model.will_sync_module_buffers():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return (
            "the DistributedDataParallel model broadcasts its buffers from rank 0 over the world at every forward, "
            "which would tie the groups together again: make it with forward_sync_buffers=False "
            "(broadcast_buffers=False on a torch without forward_sync_buffers)"
        )
    if model.find_unused_parameters:
        return (
            "the DistributedDataParallel model has find_unused_parameters=True, which allreduces a map of used "
            "parameters over the world every step and would tie the groups together again"
        )
    return None


def trainable(model: DistributedDataParallel) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def copy_into(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """`flat` (the parameters laid end to end, as parameters_to_vector lays them) into `params`, in
    place: torch's vector_to_parameters would swap their storage, which DDP's buckets still point at."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def choose_groups(
    given: Sequence[Sequence[int]] | None,
    config: HierarchicalConfig,
    nodes: Sequence[str],
    speeds: Sequence[float],
) -> list[list[int]]:
    """The command's groups, else the job's, else by measured speed (group_by speed, once every rank
    has a speed), else by node: the trainer's order (pure)."""
    world = len(nodes)
    for candidate in (given, config.groups):
        groups = [sorted(g) for g in candidate or []]
        if valid_groups(groups, world):
            return sorted(groups)
    if config.group_by == GroupBy.SPEED and all(s > 0 for s in speeds):
        return group_by_speed(list(speeds))
    return group_by_node(list(nodes))


class Subgroups:
    """The process groups hierarchical needs, each made once per process: dist.new_group is collective
    over the world, so every rank makes every group, in one order, at the same agreed step."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def _get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        if ranks not in self._made:
            self._made[ranks] = dist.new_group(ranks=list(ranks) or None)
        return self._made[ranks]

    def exchange_group(self, groups: list[list[int]], rank: int, world: dist.ProcessGroup) -> dist.ProcessGroup | None:
        """Rank's group for the gradient exchange: None when it is alone in it, `world` when it is the world."""
        size = dist.get_world_size(world)
        mine: dist.ProcessGroup | None = None
        for group in groups:
            made = world if len(group) == size else self._get(tuple(group)) if len(group) > 1 else None
            if rank in group:
                mine = made
        return mine

    def rounds(self) -> dist.ProcessGroup:
        """The world group of the cross-group rounds (the empty key: every rank)."""
        return self._get(())


def gather_groups(
    comm: Comm, node: str, speed: float, given: Sequence[Sequence[int]] | None, config: HierarchicalConfig
) -> list[list[int]]:
    """Collective: `choose_groups` with every rank's node and measured speed."""
    seen = comm.all_gather((node, speed))
    return choose_groups(given, config, [n for n, _ in seen], [s for _, s in seen])


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What the rounds consumed at a step carried: seconds waited, the newest control epoch, a stop."""

    waited: float = 0.0
    epoch: int = 0
    stop: bool = False


class Hierarchy:
    """One stay in hierarchical: made at an agreed step on every rank (collective: it may make
    process groups), which regroups the exchange; ended by `leave()`."""

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        exchange: Exchange,
        groups: list[list[int]],
        config: HierarchicalConfig,
        subgroups: Subgroups,
    ) -> None:
        rank = dist.get_rank()
        self.params, self.optimizer, self.exchange = trainable(model), optimizer, exchange
        self.groups = groups
        self.my_group = next(g for g in groups if rank in g)
        self.every, self.staleness = config.average_every, config.staleness
        exchange.group = subgroups.exchange_group(groups, rank, exchange.world)
        self.rounds = subgroups.rounds()
        log.info(
            "hierarchical: groups %s, model average every %d steps, at most %d rounds behind",
            groups,
            self.every,
            self.staleness,
        )
        self.world = dist.get_world_size(self.rounds)
        self.numel = sum(p.numel() for p in self.params)
        self.local_steps = 0
        self.outstanding: deque[tuple[dist.Work, torch.Tensor, torch.Tensor]] = deque()

    def after_step(self, offer: int, stopping: bool) -> RoundOutcome:
        """At every step boundary: a round every `every` steps, carrying `offer` (rank 0's pending
        epoch) and `stopping`; the rounds now `staleness` old are consumed (waited for, applied)."""
        self.local_steps += 1
        if self.local_steps % self.every:
            return RoundOutcome()
        snapshot = self._flat()
        tail = torch.tensor([float(offer), 1.0 if stopping else 0.0], dtype=snapshot.dtype, device=snapshot.device)
        buf = torch.cat([snapshot / self.world, tail])
        work = dist.all_reduce(buf, group=self.rounds, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        self.outstanding.append((work, buf, snapshot))
        waited, epoch, stop = 0.0, 0, False
        while len(self.outstanding) > self.staleness:
            work, buf, snapshot = self.outstanding.popleft()
            start = time.perf_counter()
            work.wait()
            waited += time.perf_counter() - start
            self._set(self._flat() + (buf[: self.numel] - snapshot) / (1 + self.staleness))
            # Every rank sums the same tails: float32 holds an epoch exactly up to 2^24.
            epoch = max(epoch, round(float(buf[self.numel])))
            stop = stop or float(buf[self.numel + 1]) > 0
        return RoundOutcome(waited, epoch, stop)

    def age(self) -> int:
        """Steps since the newest model average this rank has applied (the trainer's staleness)."""
        return len(self.outstanding) * self.every + self.local_steps % self.every

    def merge(self) -> None:
        """Collective at one agreed step: every rank ends with the mean parameters and optimizer state.
        The rounds in flight are dropped: what they carried (an epoch, a stop) is offered again."""
        while self.outstanding:
            self.outstanding.popleft()[0].wait()
        flat = self._flat() / self.world
        dist.all_reduce(flat, group=self.rounds)
        self._set(flat)
        average_state(self.optimizer, self.params)

    def leave(self) -> None:
        """Collective: merged, and the exchange back over the world."""
        self.merge()
        self.exchange.group = self.exchange.world

    def _flat(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach()

    def _set(self, flat: torch.Tensor) -> None:
        copy_into(self.params, flat)
