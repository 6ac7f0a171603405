"""Built-in datasets and the per-rank sharded batch stream.

Sharding works like torch's DistributedSampler without padding: each epoch draws one permutation of
the whole dataset from (seed, epoch), identical on every rank, and rank r of a world of N reads
positions base+r, base+r+N, ... of it. A rank's place in the stream is a `DataPosition` (epoch,
base, offset into its shard), which is all a checkpoint needs. `base` is the prefix of the epoch's
permutation consumed before the current world started: ranks of a world of N that each read `off`
samples have together read exactly positions [base, base + N*off), so a new world of any size
continues at base' = base + N*min(offsets) with offset 0 (`rebase`) and every sample is seen once
per epoch; only when the ranks' offsets differ (async, rebalanced batches) the samples between the
smallest and the largest offset are seen again (never skipped). A shard's tail shorter than a batch
is dropped (drop_last), so ranks with the same batch size take the same number of steps per epoch.

In sync with unequal batch sizes (rebalanced sync) the world reads its global batch instead
(`ShardedStream.next_batch_of`): each step takes the next sum(batch sizes) positions of the epoch's
permutation, dealt to the ranks in turn (rank r takes every N-th position while every rank still
needs samples, which is exactly the strided shard when the batches are equal). So the samples of a
step are the same whatever the split, and a rebalanced sync step computes the very gradient plain
sync (and DDP) computes at that step: a rebalance changes who computes, not what is learned.
It needs one position on every rank; entering sync agrees on it (`rebase` over the world's
positions, strategies.sync), since async and hierarchical leave the ranks at different offsets.

The trainer holds out a validation split (`held_out_indices`, fixed by the data seed): its stream
permutes only the remaining samples, so no rank ever trains on a validation sample.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from sgdjob_trainer.hooks import load_hook

SYNTHETIC_FEATURES = 16
SYNTHETIC_SAMPLES = 8192
# The teacher's label noise: the best possible mean squared error (the "noise floor") is its square.
SYNTHETIC_NOISE = 0.1
SYNTHETIC_NOISE_FLOOR = SYNTHETIC_NOISE**2
# The data is the same whatever the training seed, so every run chases the same known optimum.
_DATA_SEED = 1234


def synthetic_dataset() -> TensorDataset:
    """Teacher-student regression: y = x.w + b + noise with a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(_DATA_SEED)
    x = torch.randn(SYNTHETIC_SAMPLES, SYNTHETIC_FEATURES, generator=gen)
    w = torch.randn(SYNTHETIC_FEATURES, 1, generator=gen) / SYNTHETIC_FEATURES**0.5
    y = x @ w + 0.5 + SYNTHETIC_NOISE * torch.randn(SYNTHETIC_SAMPLES, 1, generator=gen)
    return TensorDataset(x, y)


def digits_dataset() -> TensorDataset:
    """scikit-learn's 8x8 digits (1797 images), shipped inside the scikit-learn wheel: no download."""
    table = _digits_table()
    x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1], dtype=torch.long)
    return TensorDataset(x, y)


def _digits_table() -> np.ndarray:
    """The digits as scikit-learn ships them (64 pixel columns, then the label), read from the wheel's
    data file without importing scikit-learn: the import (scipy with it) costs a worker ~1.1 s of CPU
    at every start and restart, more than the rest of its set-up, on a node with little CPU ~1.5 s."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return np.loadtxt(path, delimiter=",")
    # Another scikit-learn layout: its own loader, slower to import but the same table.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def build_dataset(name: str) -> Dataset[Any]:
    if name == "synthetic":
        return synthetic_dataset()
    if name == "digits":
        return digits_dataset()
    dataset = load_hook(name)()
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"dataset hook '{name}' returned {type(dataset).__name__}, not a map-style dataset")
    return cast(Dataset[Any], dataset)


def fetch(dataset: Dataset[Any], indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather a batch; tensor datasets are indexed directly, others collated item by item."""
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors[0], dataset.tensors[1]
        return x[indices], y[indices]
    batch = default_collate([dataset[int(i)] for i in indices])
    return batch[0], batch[1]


# At most this fraction of a dataset is held out for validation, whatever `evaluation.samples` asks.
MAX_HELD_OUT_FRACTION = 0.2


def held_out_indices(size: int, samples: int) -> torch.Tensor:
    """The validation split: min(samples, a fifth of the data) indices that no rank trains on.

    Drawn from the fixed data seed (not the training seed), so every run of a dataset validates on
    the same samples and trains on the rest; sorted, for a stable evaluation order."""
    count = max(0, min(samples, int(size * MAX_HELD_OUT_FRACTION)))
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(_DATA_SEED + 1))
    return perm[:count].sort().values


def held_out_batch(dataset: Dataset[Any], samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split's samples (`held_out_indices`), the same on every rank and in every run."""
    return fetch(dataset, held_out_indices(len(cast(Any, dataset)), samples))


def training_indices(size: int, held_out: torch.Tensor) -> torch.Tensor:
    """Every index of a dataset of `size` samples that is not held out, ascending."""
    keep = torch.ones(size, dtype=torch.bool)
    keep[held_out] = False
    return torch.arange(size)[keep]


@dataclass(slots=True)
class DataPosition:
    """Where a rank is in its data stream: what a checkpoint saves to resume without repeats."""

    epoch: int = 0
    offset: int = 0
    base: int = 0  # positions of the epoch's permutation read before this world started

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "base": self.base, "offset": self.offset}


def rebase(positions: list[DataPosition]) -> DataPosition:
    """Where every rank of a NEW world starts, given the positions of all ranks of the old one:
    the earliest epoch any old rank is in, past the prefix every old rank has read (module doc)."""
    epoch = min(p.epoch for p in positions)
    current = [p for p in positions if p.epoch == epoch]
    # Ranks already in a later epoch finished this one; the prefix is bounded by the others.
    return DataPosition(epoch=epoch, base=current[0].base + len(positions) * min(p.offset for p in current), offset=0)


class ShardedStream:
    """Batches of this rank's shard of the dataset, epoch after epoch, deterministic by seed."""

    def __init__(
        self,
        dataset: Dataset[Any],
        rank: int,
        world_size: int,
        seed: int,
        position: DataPosition | None = None,
        held_out: torch.Tensor | None = None,
    ) -> None:
        self.dataset = dataset
        total = len(cast(Any, dataset))
        # The samples this stream may read: all but the held-out validation split (held_out_indices).
        self.indices = training_indices(total, held_out) if held_out is not None else None
        self.size = total if self.indices is None else len(self.indices)
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.position = position or DataPosition()
        self._shard_key = (-1, -1)
        self._shard = torch.empty(0, dtype=torch.long)
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)
        # Tests set a list here to record every sample index this rank reads.
        self.trace: list[int] | None = None

    def _perm_for(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of the readable samples' positions, the same on every rank."""
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.size, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def _dataset_indices(self, positions: torch.Tensor) -> torch.Tensor:
        return positions if self.indices is None else self.indices[positions]

    def _shard_for(self, epoch: int, base: int = 0) -> torch.Tensor:
        if (epoch, base) != self._shard_key:
            self._shard = self._dataset_indices(self._perm_for(epoch)[base + self.rank :: self.world_size])
            self._shard_key = (epoch, base)
        return self._shard

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.position
        shard = self._shard_for(pos.epoch, pos.base)
        if pos.offset + batch_size > len(shard):
            # Mutated in place: TrainState holds this same object for checkpoints.
            pos.epoch, pos.base, pos.offset = pos.epoch + 1, 0, 0
            shard = self._shard_for(pos.epoch, pos.base)
        if batch_size > len(shard):
            raise ValueError(f"batch size {batch_size} exceeds this rank's shard of {len(shard)} samples")
        indices = shard[pos.offset : pos.offset + batch_size]
        pos.offset += batch_size
        if self.trace is not None:
            self.trace.extend(indices.tolist())
        return fetch(self.dataset, indices)

    def next_batch_of(self, batch_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the world's next global batch, given every rank's batch size (index =
        rank): the next sum(batch_sizes) positions of the epoch's permutation, dealt in turn (module
        doc). Equal sizes read exactly what `next_batch` reads. Every rank must call it with the
        same sizes at the same step, as sync's ranks do."""
        if len(batch_sizes) != self.world_size:
            raise ValueError(f"{len(batch_sizes)} batch sizes for a world of {self.world_size}")
        mine = batch_sizes[self.rank]
        if all(b == mine for b in batch_sizes):
            return self.next_batch(mine)
        total = sum(batch_sizes)
        if total > self.size:
            raise ValueError(f"global batch {total} exceeds the {self.size} samples of an epoch")
        pos = self.position
        # Where the world is in the epoch: with equal batches so far every rank has read `offset`
        # positions of its strided shard, so the world has read base + N*offset of the permutation.
        start = pos.base + self.world_size * pos.offset
        if start + total > self.size:
            pos.epoch, start = pos.epoch + 1, 0
        sizes = torch.tensor(list(batch_sizes))
        k = torch.arange(mine)
        needs = sizes.unsqueeze(0) > k.unsqueeze(1)  # [k, r]: rank r takes a k-th sample
        dealt = needs.sum(dim=1)
        # Round k hands out dealt[k] positions; this rank's k-th is after the ranks before it in that round.
        offsets = torch.cumsum(dealt, 0) - dealt + needs[:, : self.rank].sum(dim=1)
        positions = self._perm_for(pos.epoch)[start + offsets]
        pos.base, pos.offset = start + total, 0
        indices = self._dataset_indices(positions)
        if self.trace is not None:
            self.trace.extend(indices.tolist())
        return fetch(self.dataset, indices)
