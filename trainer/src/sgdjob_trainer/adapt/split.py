"""The pure core of the adaptation API: how one global batch a step is shared among the ranks, where
each rank's slice lies in the epoch's sample order, and what a control command changes of it.

The world takes one global batch per step. Rank r takes `sizes[r]` samples of it (the job's
`batchSize` unless a control command or `rankBatchSizes` says otherwise): the slice right after
the ranks below it. So whatever the split, a step reads the same samples as plain sync reads at
that step, and no sample is read twice or skipped; an epoch ends when fewer samples than one global
batch are left (they are dropped, as every rank must take the same number of steps).

A new split takes effect at a batch index every rank agrees on (`Schedule`): a data loader with
worker processes has fetched a few batches ahead, and those keep the split they were cut with.

Torch-free, so the rules are tested without a process group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand


@dataclass(frozen=True, slots=True)
class Split:
    """Each rank's batch size, rank 0 first."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, world: int, base: int, given: Mapping[int, int] | None = None) -> Split:
        """`base` for every rank of a world of `world`, but `given[r]` where given (ranks outside the
        world are dropped: a smaller world keeps the sizes of the ranks it still has, as the trainer does)."""
        given = given or {}
        return cls(tuple(given.get(r, base) for r in range(world)))

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def size(self, rank: int) -> int:
        return self.sizes[rank]

    def start(self, rank: int) -> int:
        """Where rank's slice begins within the global batch."""
        return sum(self.sizes[:rank])

    def weight(self, rank: int, among: Sequence[int] | None = None) -> float:
        """The factor on rank's mean gradient before an averaging allreduce over the ranks `among` (None:
        the world), which divides by their number, so that the average weighs every sample of their
        batches alike: b_r x |among| / their total (a hierarchical group's gradient is its own batches')."""
        ranks = range(self.world) if among is None else among
        return self.sizes[rank] * len(ranks) / sum(self.sizes[r] for r in ranks)

    def as_dict(self) -> dict[int, int]:
        return dict(enumerate(self.sizes))


@dataclass(frozen=True, slots=True)
class Position:
    """Where the world stands in the data: the epoch, the samples of its order the world has taken,
    and the global batches taken since training began (all epochs)."""

    epoch: int = 0
    cursor: int = 0
    batch: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "batch": self.batch}

    @classmethod
    def from_dict(cls, doc: Mapping[str, int]) -> Position:
        return cls(int(doc["epoch"]), int(doc["cursor"]), int(doc["batch"]))


def take(pos: Position, samples: int, split: Split, rank: int) -> tuple[range, Position] | None:
    """Rank's slice of the next global batch (indices into the epoch's order) and the position after
    it; None when the epoch has no whole global batch left."""
    if pos.cursor + split.total > samples:
        return None
    first = pos.cursor + split.start(rank)
    return range(first, first + split.size(rank)), Position(pos.epoch, pos.cursor + split.total, pos.batch + 1)


def next_epoch(pos: Position) -> Position:
    return Position(pos.epoch + 1, 0, pos.batch)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Splits by the global batch index they start at, oldest first (at least one)."""

    changes: tuple[tuple[int, Split], ...]

    @classmethod
    def starting(cls, split: Split, batch: int = 0) -> Schedule:
        return cls(((batch, split),))

    def at(self, batch: int) -> Split:
        """The split of global batch `batch`."""
        current = self.changes[0][1]
        for start, split in self.changes:
            if start > batch:
                break
            current = split
        return current

    def then(self, batch: int, split: Split, consumed: int) -> Schedule:
        """`split` from global batch `batch` on; changes no batch from `consumed` on can need are dropped."""
        kept = [(s, sp) for s, sp in self.changes if s < batch]
        live = [(s, sp) for s, sp in kept if s >= consumed]
        older = [c for c in kept if c[0] < consumed][-1:]  # the one in force at `consumed`
        return Schedule((*older, *live, (batch, split)))


@dataclass(frozen=True, slots=True)
class Ticket:
    """A rank's next samples in async (`Dispenser.take`): `indices` into `epoch`'s order, empty when
    that epoch has no whole batch of the asked size left; `world` is the world's position after it."""

    epoch: int
    indices: range
    world: Position


class Dispenser:
    """Async's data: the ranks draw their batches from one queue over the epoch's order, held by rank
    0 (the parameter server's shard 0 answers for it), so a fast rank takes more batches and every
    rank's epoch ends at its next batch after the queue runs dry. Every sample is read at most once an
    epoch, and the ranks' epoch loops stay within one batch of each other, as the script's collectives
    between epochs need; the samples of batches taken and never trained (cut ahead when async ends)
    are skipped, at most a prefetch lag a rank. `batch` counts the global batches of `total` samples
    the world has taken (the Schedule's index in sync)."""

    def __init__(self, position: Position, samples: int, total: int) -> None:
        self.position, self.samples, self.total = position, samples, total
        self._taken = 0  # samples taken since `position.batch` was last whole

    def take(self, epoch: int, size: int) -> Ticket:
        """`size` samples of `epoch` for one rank: an epoch the queue has left is over for the asker;
        a later one (the first rank to start it) begins it."""
        pos = self.position
        if epoch > pos.epoch:
            pos, self._taken = Position(epoch, 0, pos.batch), 0
        if epoch < pos.epoch or pos.cursor + size > self.samples or size < 1:
            self.position = pos
            return Ticket(epoch, range(0), pos)
        self._taken += size
        whole, self._taken = divmod(self._taken, max(self.total, 1))
        self.position = Position(pos.epoch, pos.cursor + size, pos.batch + whole)
        return Ticket(epoch, range(pos.cursor, pos.cursor + size), self.position)

    def words(self, epoch: int, size: int) -> list[int]:
        """`take` as the parameter server carries it (strategies/ps.py TICKET_WORDS)."""
        t = self.take(epoch, size)
        return [t.epoch, t.indices.start, t.indices.stop, t.world.epoch, t.world.cursor, t.world.batch]

    @staticmethod
    def ticket(words: list[int]) -> Ticket:
        epoch, first, end, *world = words
        return Ticket(epoch, range(first, end), Position(*world))


@dataclass(frozen=True, slots=True)
class Applied:
    """A command's outcome on one process: the split now, and what of the command was refused (None: nothing)."""

    split: Split
    refused: str | None = None
    mode: SyncMode | None = None  # the mode to switch to (None: keep the current one)


def apply_command(
    split: Split,
    command: ControlCommand,
    samples: int | None,
    hierarchical: str | None,
    asynchronous: str | None,
) -> Applied:
    """What a script on the adaptation API makes of `command`, with `samples` in its epoch (None:
    it reads its data without the session's loader, so no split can reach its data); `hierarchical`
    and `asynchronous`: why the script cannot run that mode (None: it can; hierarchy.obstacle,
    asynchronous.obstacle).

    The mode (sync, or hierarchical or async where the script can) and the per-rank batch sizes are applied;
    what cannot be, is refused with the reason, and the rest of the command still applies: a
    controller stores every command it sent merged into one, so a part refused once comes back with
    every later command."""
    refused: list[str] = []
    mode = command.mode
    if mode == SyncMode.ASYNC and asynchronous is not None:
        refused.append(f"mode async refused: {asynchronous}")
        mode = None
    elif mode == SyncMode.HIERARCHICAL and hierarchical is not None:
        refused.append(f"mode hierarchical refused: {hierarchical}")
        mode = None
    sizes = command.batch_sizes or {}
    if sizes and samples is None:
        refused.append("batch sizes refused: the script reads its data without session.loader(), which cuts the split")
    elif sizes and samples is not None:
        bad = {r: b for r, b in sizes.items() if not 0 <= r < split.world or b < 1}
        if bad:
            refused.append(f"batch sizes for unknown ranks or below 1 ignored: {bad}")
        wanted = Split.of(split.world, 0, {**split.as_dict(), **{r: b for r, b in sizes.items() if r not in bad}})
        if wanted.total > samples:
            refused.append(
                f"batch sizes refused: their global batch of {wanted.total} exceeds the {samples} samples of an epoch"
            )
        else:
            split = wanted
    return Applied(split, "; ".join(refused) or None, mode)


def prefetch_lag(num_workers: int, prefetch_factor: int | None) -> int:
    """Batches a torch DataLoader may have cut ahead of the one its loop holds: none without worker
    processes (the loop's `next` cuts the batch), else prefetch_factor (torch: 2) per worker."""
    if num_workers <= 0:
        return 0
    return num_workers * (prefetch_factor if prefetch_factor is not None else 2)


def batches_left(pos: Position, samples: int, split: Split) -> int:
    """Whole global batches left in the epoch at `split`."""
    return max(0, (samples - pos.cursor) // split.total) if split.total > 0 else 0
