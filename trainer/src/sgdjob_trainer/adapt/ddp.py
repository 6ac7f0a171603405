"""What the session adds to the script's DistributedDataParallel model: a communication hook around
DDP's own averaging allreduce.

- Weighting: DDP averages the ranks' gradients equally, which is the mean over the global batch only
  when every rank has the same batch. Under a split (split.py) each rank's mean gradient is scaled by
  its `Split.weight` first, so the average weighs every sample alike, as one big batch would.
- Timing: the policy needs each rank's own speed, and in sync the slow rank makes every other rank's
  backward pass wait in the allreduce. The hook notes when the last bucket is launched (the rank's
  backward compute is done then; gloo runs a group's allreduces in order, so that one finishes
  last) and when it completes: the difference is the rank's wait in the exchange, the rest of the
  step is its compute. On GPUs (nccl) the completion is noted when the allreduce's future completes.
- Groups: in hierarchical (hierarchy.py) the allreduce runs over the rank's group only, and a rank
  alone in its group keeps its own gradient.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with its own classes.
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


class Exchange:
    """The hook's state: the weight of this rank's gradient and the seconds waited since `take_wait`."""

    def __init__(self, model: DistributedDataParallel, on_computed: Callable[[], None]) -> None:
        self.world: dist.ProcessGroup = model.process_group
        self.group: dist.ProcessGroup | None = self.world  # None: alone in its hierarchical group
        self.on_computed = on_computed
        self.weight = 1.0
        self._waited = 0.0
        self._lock = threading.Lock()  # the completion callback runs on the backend's thread
        model.register_comm_hook(self, _hook)

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self._waited += seconds

    def take_wait(self) -> float:
        with self._lock:
            waited, self._waited = self._waited, 0.0
        return waited


def _hook(state: Exchange, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    if state.weight != 1.0:
        bucket.buffer().mul_(state.weight)
    last = bucket.is_last()
    if last:
        state.on_computed()
    if state.group is None:
        alone: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        alone.set_result(bucket.buffer())
        return alone
    launched = time.perf_counter()
    future = default_hooks.allreduce_hook(state.group, bucket)
    if not last:
        return future

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.add_wait(time.perf_counter() - launched)
        return fut.value()

    return future.then(done)
