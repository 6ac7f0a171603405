"""The interface every synchronisation mode implements, and what they share.

Life cycle, driven by the Trainer:
- `enter()` is called on every rank at a switch point, when every rank holds the same model and
  the same step; it may run collectives (it is the only time a new process group can be made).
- `step(offer)` runs one training step of this rank, exchange included. `offer()` is the epoch of
  rank 0's pending control command (0 on the other ranks); a mode calls it as late as its exchange
  allows, so a command sent during the step can still ride it. The result's `seen_epoch` is the
  epoch the mode has carried to every rank. The contract: every rank sees a given epoch at the same step in
  sync and hierarchical mode; in async mode each worker sees it at its next exchange, and the
  Trainer's switch barrier then agrees on one step for all.
- `leave()` is collective; when it returns every rank holds the same model (async: the parameter
  server's; hierarchical: the average over ranks; sync: already equal).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from sgdjob_trainer.config import Compression, SyncMode, TrainingConfig
from sgdjob_trainer.data import ShardedStream
from sgdjob_trainer.emulation import ComputeEmulator
from sgdjob_trainer.gradient_stats import GradientStats
from sgdjob_trainer.levers import autocast
from sgdjob_trainer.networks import LossFn
from sgdjob_trainer.optim import set_lr
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.streaming import IterableStream
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.train_state import TrainState

if TYPE_CHECKING:
    from sgdjob_trainer.strategies.ps import ParameterServer


def exchange_bytes(params: Sequence[torch.Tensor], compression: Compression) -> int:
    """Bytes of one gradient in `Strategy.weighted_allreduce`, as it goes on the wire: each trainable
    parameter's gradient (a gradient has its parameter's dtype), in bf16 under bf16 compression. The
    few-element tail beside it is left out: it costs latency, not bandwidth. Async pushes to the
    parameter servers are fp32 and never compressed: under compression they send twice this."""
    trainable = [p for p in params if p.requires_grad]
    if compression == Compression.BF16:
        return sum(p.numel() for p in trainable) * torch.bfloat16.itemsize
    return sum(p.numel() * p.element_size() for p in trainable)


@dataclass(slots=True)
class StepResult:
    loss: float
    samples: int  # samples whose gradient reached the model
    compute_s: float
    wait_s: float
    staleness: float = 0.0
    seen_epoch: int = 0
    stop: bool = False  # async: the job's step budget was reached by some worker
    interrupted: bool = False  # a graceful stop (SIGTERM) reached every rank at this step
    checkpoint: int = 0  # async: the newest checkpoint step rank 0 asked for (shard 0's reply)


@dataclass(slots=True)
class Context:
    """What a strategy works on; owned by the Trainer, shared by all strategies of one process."""

    info: WorldInfo
    device: torch.device
    training: TrainingConfig
    state: TrainState
    stream: ShardedStream | IterableStream
    emulator: ComputeEmulator
    loss_fn: LossFn
    # Every parameter group's learning rate is its base rate x lr_scale (the world-size rule) x
    # schedule(step) (lrPolicy or the task's lr_lambda); see optim.py.
    lr_scale: float
    schedule: Callable[[int], float]
    telemetry: Telemetry
    ps: ParameterServer | None = None
    # The CPU (gloo) group for small control exchanges when training runs on nccl; None: the
    # default group is gloo already.
    ctl: dist.ProcessGroup | None = None
    # Set (from the SIGTERM handler) when this process is asked to stop gracefully.
    stopping: threading.Event = field(default_factory=threading.Event)
    # Process groups are made collectively and never freed mid-run; reuse them across switches.
    group_cache: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)
    # Gradient noise and drift from the synchronous exchanges (what the controller's cost model
    # weighs staleness and batch size by); kept across mode switches.
    grad_stats: GradientStats = field(default_factory=GradientStats)

    def batch_size(self, rank: int | None = None) -> int:
        r = self.info.rank if rank is None else rank
        return self.state.batch_sizes.get(r, self.training.batch_size)

    def total_batch(self) -> int:
        return sum(self.batch_size(r) for r in range(self.info.world_size))

    def batch_lr_scale(self) -> float:
        """The learning rate of an update over the world's batches relative to one over the job's
        global batch (`batchSize` x world), by training.lrScaling: 1 for any split that keeps the
        global batch; a trimmed one (the policy's `trim`: the fast ranks keep their batch, the slow
        ones take what they finish in the same time) moves the rate with the batch, as a resized
        world does."""
        planned = self.training.batch_size * self.info.world_size
        total = self.total_batch()
        if planned <= 0 or total <= 0 or total == planned:
            return 1.0
        return self.training.lr_scaling.factor(total, planned)


class Strategy(ABC):
    mode: ClassVar[SyncMode]
    # Every rank steps together on one global batch (sync): a rank reads its part of that batch, so
    # the step's samples do not depend on how the batch is split (data.ShardedStream.next_batch_of).
    global_batch: ClassVar[bool] = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.params = [p for p in ctx.state.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

    def enter(self) -> None:  # noqa: B027 - optional hook, most modes need nothing
        """Collective; called with a consistent model on every rank."""

    @abstractmethod
    def step(self, offer: Callable[[], int]) -> StepResult: ...

    def leave(self) -> None:  # noqa: B027
        """Collective; returns with the same model on every rank."""

    def checkpoint_weight(self) -> int:
        """How many ranks the model on this rank stands for in a checkpoint (0: not an owner)."""
        return self.ctx.info.world_size if self.ctx.info.rank == 0 else 0

    # -- shared pieces ---------------------------------------------------------------------------
    def compute_gradients(self) -> tuple[float, float, int]:
        """Forward and backward on this rank's next `gradientAccumulationSteps` micro-batches (under
        autocast; the loss scaled for fp16), plus the emulated compute; returns (mean loss,
        compute seconds, samples)."""
        ctx = self.ctx
        ctx.telemetry.computing = True
        try:
            return self._compute_gradients()
        finally:
            ctx.telemetry.computing = False

    def _compute_gradients(self) -> tuple[float, float, int]:
        ctx = self.ctx
        start = time.perf_counter()
        batch_size = ctx.batch_size()
        accumulate = ctx.training.gradient_accumulation_steps
        model = ctx.state.model
        for p in self.params:
            p.grad = None
        # Gradients add up over micro-batches; dividing each loss by their number makes the sum
        # the mean over all samples, as one big batch would give.
        factor = ctx.state.scaler.scale / accumulate
        total = 0.0
        stream = ctx.stream
        split = [ctx.batch_size(r) for r in range(ctx.info.world_size)] if self.global_batch else []
        for _ in range(accumulate):
            if self.global_batch and isinstance(stream, ShardedStream):
                x, y = stream.next_batch_of(split)
            else:  # another mode, or a streaming dataset (each rank reads its own stream)
                x, y = stream.next_batch(batch_size)
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with autocast(ctx.training.precision, ctx.device):
                loss = ctx.loss_fn(model(x), y)
            (loss.float() * factor).backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach()) / accumulate
        samples = batch_size * accumulate
        ctx.emulator.run(ctx.state.step, samples)
        return total, time.perf_counter() - start, samples

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

    def weighted_allreduce(
        self,
        group: dist.ProcessGroup | None,
        samples: int,
        offer: Callable[[], int] | None = None,
    ) -> tuple[float, int, bool, bool]:
        """Sample-weighted gradient average over `group`: each rank sends grad x its samples, and a
        tail of its samples, its offered control epoch (rank 0's is the only non-zero one, so the
        sum is that epoch) and whether it is stopping. Unscales the average (fp16) and sets it as the
        gradient. Returns (wait seconds, seen epoch, a rank is stopping, gradient finite).

        Gradient and tail are ONE allreduce, the offer read when this rank enters it: a command that
        reaches rank 0 while it waits in the exchange rides the next step. (Until 2026-12-04 rank 0
        read it after the wait, in a second, tiny allreduce, while it waited for a slower rank: one
        step sooner, but under a real CPU quota the second collective a step cost sync 25-35 % of its
        throughput against DDP's one (bench.goodput --real-cpu 0.6, one-straggler); on emulated compute
        it had cost 2-3 %.) A hierarchical group (`offer` None) carries no epoch: its epoch travels in
        the cross-group round. Under bf16 compression the gradient travels as bf16 (half the bytes)
        and the exact tail is a second allreduce."""
        flat = self.flat_grads()
        start = time.perf_counter()
        epoch = offer() if offer is not None else 0
        if self.ctx.training.compression != Compression.BF16:
            tail = self._tail(samples, epoch, flat.device)
            buf = torch.cat([flat * samples, tail.to(flat.dtype)])
            dist.all_reduce(buf, group=group)
            summed, tail = buf[: self.numel], buf[self.numel :].double()
        else:
            packed = (flat * samples).to(torch.bfloat16)
            dist.all_reduce(packed, group=group)
            tail = self._tail(samples, epoch, flat.device)
            dist.all_reduce(tail, group=group)
            summed = packed.to(flat.dtype)
        wait = time.perf_counter() - start
        average = summed / float(tail[0])
        scale = self.ctx.state.scaler.scale
        finite = self.ctx.state.scaler.unscale(average)
        if finite:  # the whole world's step, or a hierarchical group's
            own = flat / scale if scale != 1.0 else flat
            self.ctx.grad_stats.observe(own, samples, average, round(float(tail[0])))
        self.set_grads(average)
        return wait, round(float(tail[1])), float(tail[2]) > 0, finite

    def _tail(self, samples: int, epoch: int, device: torch.device) -> torch.Tensor:
        stop = 1.0 if self.ctx.stopping.is_set() else 0.0
        return torch.tensor([float(samples), float(epoch), stop], device=device, dtype=torch.float64)

    def optimizer_step(self, finite: bool = True) -> float:
        """One update at the scheduled learning rate; skipped for a non-finite (fp16) gradient."""
        start = time.perf_counter()
        ctx = self.ctx
        # Sync's update is over the global batch, whose size a trimmed split changes.
        batch = ctx.batch_lr_scale() if self.global_batch else 1.0
        set_lr(ctx.state.optimizer, ctx.lr_scale * batch * ctx.schedule(ctx.state.step))
        if finite:
            ctx.state.optimizer.step()
        return time.perf_counter() - start
