"""The session's small agreements between ranks: over a gloo group of its own, or trivially when the
process trains alone. Its own group keeps them apart from the script's collectives (DDP's gradient
allreduce runs on the default group, whatever its backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """`group` None: one process, every agreement is its own value."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @classmethod
    def for_world(cls, world: int) -> Comm:
        """Collective when `world` > 1: every rank makes the group at the same point."""
        return cls(dist.new_group(backend="gloo") if world > 1 else None)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (picklable)."""
        if self.group is None:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), rank 0's first."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_max(self, values: list[int]) -> list[int]:
        return self.start_round(values)()

    def all_min(self, value: int) -> int:
        return -self.all_max([-value])[0]

    def start_round(self, values: list[int]) -> Callable[[], list[int]]:
        """Start a MAX-allreduce of `values` without waiting; the returned function waits and gives the
        result. Every rank must start the same rounds in the same order."""
        if self.group is None:
            return lambda: list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None  # async_op=True always returns a handle

        def wait() -> list[int]:
            work.wait()
            return [int(v) for v in tensor.tolist()]

        return wait
