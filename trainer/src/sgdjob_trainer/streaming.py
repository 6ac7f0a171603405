"""Per-rank batches of a streaming (iterable) dataset.

Sharding rule: rank r of a world of N takes the items at positions base+r, base+r+N, base+r+2N, ...
of each epoch's stream (the dataset's `set_epoch(epoch)` is called first when it has one, so it can
reshuffle per epoch). It is the map-style rule (data.py) with the stream's order as the epoch's
permutation, and it uses the same `DataPosition`, so checkpoints, elastic restarts and `rebase`
work unchanged:
- within one world, exactly once per epoch: the ranks read disjoint positions and together every
  position up to the end of the stream, except each rank's final partial batch (dropped, as
  drop_last);
- across a change of world (a restart, a rescale) at least once: the new world continues after the
  prefix every old rank had read, so the items between the slowest and the fastest rank's positions
  (async or rebalanced batches) are read again, never skipped.
Cost: every rank iterates the whole stream and keeps one item in N, and a resumed rank re-reads the
epoch's stream up to its position. A source that can start at an offset or shard itself cheaply
saves that; the rule here needs nothing from the dataset but iteration.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from sgdjob_trainer.data import DataPosition


class IterableStream:
    """Batches of this rank's share of an iterable dataset, epoch after epoch (module doc)."""

    size: int | None = None  # unknown: a stream has no length

    def __init__(
        self, dataset: IterableDataset[Any], rank: int, world_size: int, position: DataPosition | None = None
    ) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.position = position or DataPosition()
        self._items: Iterator[tuple[int, Any]] | None = None
        self._at: tuple[int, int, int] = (-1, -1, -1)
        # Tests set a list here to record the stream position of every item this rank reads.
        self.trace: list[int] | None = None

    def _open(self) -> None:
        pos = self.position
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(pos.epoch)
        start = pos.base + self.rank + pos.offset * self.world_size
        self._items = itertools.islice(enumerate(iter(self.dataset)), start, None, self.world_size)
        self._at = (pos.epoch, pos.base, pos.offset)

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.position
        if self._items is None or self._at != (pos.epoch, pos.base, pos.offset):
            self._open()  # first call, or the position was set from a checkpoint
        batch: list[tuple[int, Any]] = []
        fresh_epoch = False
        while len(batch) < batch_size:
            assert self._items is not None
            item = next(self._items, None)
            if item is not None:
                batch.append(item)
                continue
            if fresh_epoch:
                raise ValueError(
                    f"training.task: the training stream gives rank {self.rank} of {self.world_size} fewer than "
                    f"{batch_size} items (batchSize) in a whole epoch; give a longer stream, a smaller batchSize "
                    "or fewer workers"
                )
            # End of the epoch: the partial batch is dropped, the next epoch starts at its beginning.
            pos.epoch, pos.base, pos.offset = pos.epoch + 1, 0, 0
            self._open()
            batch, fresh_epoch = [], True
        pos.offset += batch_size
        self._at = (pos.epoch, pos.base, pos.offset)
        if self.trace is not None:
            self.trace.extend(index for index, _ in batch)
        x, y = default_collate([sample for _, sample in batch])
        return x, y
