"""The session's data loader: a torch DataLoader over the script's dataset whose batches are this
rank's slice of one global batch a step (split.py), in place of DistributedSampler + DataLoader.

It keeps the world's data position (the last batch it handed out), so a checkpoint resumes at the
sample where the world stood, and a new split starts at a batch index every rank agrees on: the
next batch not yet cut on any rank (`split.prefetch_lag`). Iterating it again after a `break`
continues where the loop left off; batches cut ahead and never handed out are cut again.

In async (asynchronous.py) the rank's batches come from the world's queue instead (`dispense`), and
leaving async moves every rank to the queue's position (`relocate`): a rank whose loop is still in
an epoch the world has left ends that loop, so every rank's epoch loop stays the world's. Once the
world's training is over (`ending`, another rank finished in async) it hands out no more batches.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from sgdjob_trainer.adapt.split import Position, Schedule, Split, Ticket, batches_left, next_epoch, take

log = logging.getLogger("sgdjob_trainer.adapt")

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
        # In async: (epoch, size) -> this rank's next samples from the world's queue (asynchronous.py).
        self.dispense: Callable[[int, int], Ticket] | None = None
        self.ending: Callable[[], bool] = lambda: False
        self.on_epoch_end: Callable[[], None] = lambda: None  # before the loop's end (async: a meeting)
        self._relocated = False
        self._told_ending = False
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

    def relocate(self, position: Position, split: Split) -> None:
        """Every rank to `position` with `split` from it (an agreed step boundary, leaving or entering
        async): batches cut ahead are dropped; a loop in an epoch before `position`'s ends."""
        self.position = position
        self._schedule = Schedule.starting(split, position.batch)
        self._relocated = True

    def resplit(self, split: Split) -> None:
        """`split` from the first batch no rank has cut yet (called at a step boundary, where every
        rank has handed out the same number of batches)."""
        start = self.position.batch + self.lag
        self._schedule = self._schedule.then(start, split, self.position.batch)

    def _epoch_over(self) -> bool:
        """Whether the position leaves no batch of this epoch: in async for some rank (the queue gives
        none that does not fit, and that rank's epoch ends), in sync no whole global batch."""
        split = self.split
        if self.dispense is not None:
            return self.position.cursor + max(split.sizes, default=0) > self.samples
        return batches_left(self.position, self.samples, split) == 0

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
            if self.dispense is not None:
                ticket = self.dispense(pos.epoch, split.size(self.rank))
                if not ticket.indices:
                    return
                indices, pos = ticket.indices, ticket.world
            else:
                got = take(pos, self.samples, split, self.rank)
                if got is None:
                    return
                indices, pos = got
            self._cut_ahead.append((pos, split))
            yield [order[i] for i in indices]

    def __iter__(self) -> Iterator[Any]:
        epoch = self.position.epoch
        self._cut_ahead.clear()
        self._relocated = False
        batches = iter(self._loader)
        while True:
            if self.ending():
                if not self._told_ending:  # a loop that counts steps of its own would spin here unseen
                    self._told_ending = True
                    log.warning(
                        "training is over (another rank finished in async): the loader hands out no more "
                        "batches; a loop of your own ends on session.ending or session.step_count"
                    )
                return
            if self._relocated:
                self._relocated = False
                # An epoch the world's position leaves no batch in is over here, on every rank alike: in
                # async the others may have met at its end in the very meeting this rank came to from a
                # checkpoint's call, and would never join a second one.
                if self.position.epoch == epoch and self._epoch_over():
                    self.position = next_epoch(self.position)
                if self.position.epoch > epoch:
                    return  # the world has left this loop's epoch; the next loop starts at `position`
                self._cut_ahead.clear()
                batches = iter(self._loader)
            self._on_fetch()
            try:
                batch = next(batches)
            except StopIteration:
                self.on_epoch_end()
                self.position = next_epoch(self.position)
                return
            self.position, split = self._cut_ahead.popleft()
            self._on_batch(split.size(self.rank), split.weight(self.rank, self.among))
            yield batch
