"""Synchronous SGD: every step, one allreduce of sample-weighted gradients over the whole world.

With equal batch sizes this is exactly what torch's DistributedDataParallel computes (the mean of
the ranks' gradients, then the same optimizer step on every rank). With per-rank batch sizes
(rebalanced sync, ControlCommand.batchSizes) each rank's gradient weighs by its samples, so the
update is the mean over all samples of the step, as if one big batch had been used; and since the
ranks read their parts of one global batch (data.ShardedStream.next_batch_of), it is the update
plain sync makes at that step, whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.data import DataPosition, ShardedStream, rebase
from sgdjob_trainer.strategies.base import StepResult, Strategy


class SyncStrategy(Strategy):
    mode = SyncMode.SYNC
    global_batch = True

    def enter(self) -> None:
        """Agree on one data position: after async or hierarchical (or a resume of their checkpoint)
        the ranks stand at different offsets of their shards, and one global batch a step
        (`next_batch_of`) read from different positions would skip samples and read others twice.
        `rebase` takes the prefix every rank has read: nothing skipped, the samples between the
        slowest and the fastest rank's offsets read again."""
        ctx = self.ctx
        stream = ctx.stream
        if not isinstance(stream, ShardedStream) or ctx.info.world_size < 2:
            return
        pos = stream.position
        mine = torch.tensor([pos.epoch, pos.base, pos.offset], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(ctx.info.world_size)]
        dist.all_gather(every, mine, group=ctx.ctl)  # CPU tensors: the gloo group under nccl
        positions = [DataPosition(epoch=int(t[0]), base=int(t[1]), offset=int(t[2])) for t in every]
        if all(p == positions[0] for p in positions):
            return
        agreed = rebase(positions)
        # In place: the TrainState holds this same object for checkpoints.
        pos.epoch, pos.base, pos.offset = agreed.epoch, agreed.base, agreed.offset

    def step(self, offer: Callable[[], int]) -> StepResult:
        loss, compute, samples = self.compute_gradients()
        wait, seen, stopping, finite = self.weighted_allreduce(None, samples, offer)
        compute += self.optimizer_step(finite)
        return StepResult(
            loss=loss,
            samples=samples if finite else 0,
            compute_s=compute,
            wait_s=wait,
            seen_epoch=seen,
            interrupted=stopping,
        )
