"""The session's data loader: a torch DataLoader over the script's dataset whose batches are this
rank's slice of one global batch a step (split.py), in place of DistributedSampler + DataLoader.

It keeps the world's data position (the last batch it handed out), so a checkpoint resumes at the
sample where the world stood, and a new split starts at a batch index every rank agrees on: the
next batch not yet cut on any rank (`split.prefetch_lag`). Iterating it again after a `break`
continues where the loop left off; batches cut ahead and never handed out are cut again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from sgdjob_trainer.adapt.split import Position, Schedule, Split, batches_left, next_epoch, take

# DataLoader arguments the loader sets itself: the batches are its to cut.
OWN_ARGUMENTS = frozenset({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"})


class _Slices(Sampler[list[int]]):
    def __init__(self, owner: AdaptiveLoader) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        return self.owner._cut()


class AdaptiveLoader:
    """Iterate it once per epoch (`for batch in loader`); `epoch` is the epoch of the next batch.
    Made by `Session.loader`, which tells it about new splits (`resplit`)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        rank: int,
        split: Split,
        position: Position,
        shuffle: bool,
        seed: int,
        lag: int,
        on_fetch: Callable[[], None],
        on_batch: Callable[[int, float], None],
        **loader_args: Any,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError("session.loader needs a dataset with a length (a map-style Dataset)")
        self.samples = len(dataset)
        self.rank, self.shuffle, self.seed, self.lag = rank, shuffle, seed, lag
        self.position = position  # after the last batch handed out
        self._schedule = Schedule.starting(split, position.batch)
        self._on_fetch, self._on_batch = on_fetch, on_batch
        # Per batch cut and not yet handed out: the position after it and its split.
        self._cut_ahead: deque[tuple[Position, Split]] = deque()
        # The ranks whose gradients this rank's is averaged with (None: the world; hierarchical: its
        # group). Read at hand-out, not at the cut: a batch cut ahead may be trained after a switch.
        self.among: tuple[int, ...] | None = None
        self._loader: DataLoader[Any] = DataLoader(dataset, batch_sampler=_Slices(self), **loader_args)

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def split(self) -> Split:
        """The split of the next batch."""
        return self._schedule.at(self.position.batch)

    @property
    def batch_size(self) -> int:
        """This rank's size of the next batch."""
        return self.split.size(self.rank)

    def __len__(self) -> int:
        """Batches left in this epoch at the split in force."""
        return batches_left(self.position, self.samples, self.split)

    def resume_position(self, split: Split) -> Position:
        """Where a checkpoint taken now resumes with `split` (the newest): an epoch with no whole global
        batch left is over, so a resumed script's epoch loop does not enter it again."""
        return next_epoch(self.position) if batches_left(self.position, self.samples, split) == 0 else self.position

    def resplit(self, split: Split) -> None:
        """`split` from the first batch no rank has cut yet (called at a step boundary, where every
        rank has handed out the same number of batches)."""
        start = self.position.batch + self.lag
        self._schedule = self._schedule.then(start, split, self.position.batch)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order: list[int] = torch.randperm(self.samples, generator=generator).tolist()
        return order

    def _cut(self) -> Iterator[list[int]]:
        """This rank's index batches from the handed-out position to the end of its epoch."""
        pos = self.position
        order = self._order(pos.epoch)
        while True:
            split = self._schedule.at(pos.batch)
            got = take(pos, self.samples, split, self.rank)
            if got is None:
                return
            indices, pos = got
            self._cut_ahead.append((pos, split))
            yield [order[i] for i in indices]

    def __iter__(self) -> Iterator[Any]:
        self._cut_ahead.clear()
        batches = iter(self._loader)
        while True:
            self._on_fetch()
            try:
                batch = next(batches)
            except StopIteration:
                self.position = next_epoch(self.position)
                return
            self.position, split = self._cut_ahead.popleft()
            self._on_batch(split.size(self.rank), split.weight(self.rank, self.among))
            yield batch
