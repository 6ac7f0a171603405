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

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.strategies.base import StepResult, Strategy


class SyncStrategy(Strategy):
    mode = SyncMode.SYNC
    global_batch = True

    def step(self, offer: Callable[[], int]) -> StepResult:
        loss, compute, samples = self.compute_gradients()
        wait, seen, stopping, finite = self.weighted_allreduce(None, samples, offer, compute)
        compute += self.optimizer_step(finite)
        return StepResult(
            loss=loss,
            samples=samples if finite else 0,
            compute_s=compute,
            wait_s=wait,
            seen_epoch=seen,
            interrupted=stopping,
        )
