"""The interface every synchronisation mode implements, and what they share.

Life cycle, driven by the Trainer:
- `enter()` is called on every rank at a switch point, when every rank holds the same model and
  the same step; it may run collectives (it is the only time a new process group can be made).
- `step(offered_epoch)` runs one training step of this rank, exchange included. Rank 0 offers the
  epoch of its pending control command (others offer 0); the result's `seen_epoch` is the epoch the
  mode has carried to every rank. The contract: every rank sees a given epoch at the same step in
  sync and hierarchical mode; in async mode each worker sees it at its next exchange, and the
  Trainer's switch barrier then agrees on one step for all.
- `leave()` is collective; when it returns every rank holds the same model (async: the parameter
  server's; hierarchical: the average over ranks; sync: already equal).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from sgdjob_trainer.config import SyncMode, TrainingConfig
from sgdjob_trainer.data import ShardedStream
from sgdjob_trainer.emulation import ComputeEmulator
from sgdjob_trainer.models import LossFn
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.state import TrainState
from sgdjob_trainer.telemetry import Telemetry

if TYPE_CHECKING:
    from sgdjob_trainer.strategies.ps import ParameterServer


@dataclass(slots=True)
class StepResult:
    loss: float
    samples: int  # samples whose gradient reached the model
    compute_s: float
    wait_s: float
    staleness: float = 0.0
    seen_epoch: int = 0
    stop: bool = False  # async: the job's step budget was reached by some worker


@dataclass(slots=True)
class Context:
    """What a strategy works on; owned by the Trainer, shared by all strategies of one process."""

    info: WorldInfo
    device: torch.device
    training: TrainingConfig
    state: TrainState
    stream: ShardedStream
    emulator: ComputeEmulator
    loss_fn: LossFn
    lr: float
    telemetry: Telemetry
    ps: ParameterServer | None = None
    # Process groups are made collectively and never freed mid-run; reuse them across switches.
    group_cache: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)

    def batch_size(self, rank: int | None = None) -> int:
        r = self.info.rank if rank is None else rank
        return self.state.batch_sizes.get(r, self.training.batch_size)

    def total_batch(self) -> int:
        return sum(self.batch_size(r) for r in range(self.info.world_size))


class Strategy(ABC):
    mode: ClassVar[SyncMode]

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.params = [p for p in ctx.state.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

    def enter(self) -> None:  # noqa: B027 - optional hook, most modes need nothing
        """Collective; called with a consistent model on every rank."""

    @abstractmethod
    def step(self, offered_epoch: int) -> StepResult: ...

    def leave(self) -> None:  # noqa: B027
        """Collective; returns with the same model on every rank."""

    # -- shared pieces ---------------------------------------------------------------------------
    def compute_gradients(self) -> tuple[float, float, int]:
        """Forward and backward on this rank's next batch, plus the emulated compute; returns
        (loss, compute seconds, batch size)."""
        ctx = self.ctx
        start = time.perf_counter()
        batch_size = ctx.batch_size()
        x, y = ctx.stream.next_batch(batch_size)
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        model = ctx.state.model
        for p in self.params:
            p.grad = None
        loss = ctx.loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        value = float(loss.detach())
        ctx.emulator.run(ctx.state.step, batch_size)
        return value, time.perf_counter() - start, batch_size

    def flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def set_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_params(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset : offset + n].view_as(p))
                offset += n

    def reset_optimizer(self) -> None:
        """Momentum from another mode's update rule does not carry over a switch."""
        self.ctx.state.optimizer.state.clear()

    def weighted_allreduce(self, group: dist.ProcessGroup | None, batch_size: int, offered_epoch: int) -> tuple[float, int]:
        """Sample-weighted gradient average over `group` in ONE allreduce: each rank sends
        grad x its batch size, its batch size, and its offered control epoch (rank 0's is the only
        non-zero one, so the sum is that epoch). Returns (wait seconds, seen epoch)."""
        flat = self.flat_grads()
        tail = torch.tensor([float(batch_size), float(offered_epoch)], device=flat.device, dtype=flat.dtype)
        buf = torch.cat([flat * batch_size, tail])
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        wait = time.perf_counter() - start
        self.set_grads(buf[: self.numel] / buf[self.numel])
        return wait, round(float(buf[self.numel + 1]))

    def optimizer_step(self) -> float:
        start = time.perf_counter()
        self.ctx.state.optimizer.step()
        return time.perf_counter() - start
