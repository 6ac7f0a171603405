"""Built-in datasets and the per-rank sharded batch stream.

Sharding works like torch's DistributedSampler without padding: each epoch draws one permutation of
the whole dataset from (seed, epoch), identical on every rank, and rank r of a world of N reads
positions r, r+N, r+2N, ... of it. A rank's place in the stream is a `DataPosition` (epoch, offset
into its shard), which is all a checkpoint needs; on a world-size change the offset is rescaled so
the same fraction of the epoch counts as consumed. A shard's tail shorter than a batch is dropped
(drop_last), so ranks with the same batch size take the same number of steps per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

SYNTHETIC_FEATURES = 16
SYNTHETIC_SAMPLES = 8192
# The teacher's label noise: the best possible mean squared error (the "noise floor") is its square.
SYNTHETIC_NOISE = 0.1
SYNTHETIC_NOISE_FLOOR = SYNTHETIC_NOISE**2
# The data is the same whatever the training seed, so every run chases the same known optimum.
_DATA_SEED = 1234
EVAL_SAMPLES = 512


def synthetic_dataset() -> TensorDataset:
    """Teacher-student regression: y = x.w + b + noise with a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(_DATA_SEED)
    x = torch.randn(SYNTHETIC_SAMPLES, SYNTHETIC_FEATURES, generator=gen)
    w = torch.randn(SYNTHETIC_FEATURES, 1, generator=gen) / SYNTHETIC_FEATURES**0.5
    y = x @ w + 0.5 + SYNTHETIC_NOISE * torch.randn(SYNTHETIC_SAMPLES, 1, generator=gen)
    return TensorDataset(x, y)


def digits_dataset() -> TensorDataset:
    """scikit-learn's 8x8 digits (1797 images), shipped inside the scikit-learn wheel: no download."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    return TensorDataset(x, y)


def build_dataset(name: str) -> Dataset[Any]:
    if name == "synthetic":
        return synthetic_dataset()
    if name == "digits":
        return digits_dataset()
    from sgdjob_trainer.models import load_hook

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


def eval_batch(dataset: Dataset[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed sample of the data for the initial and final loss, the same on every rank."""
    n = len(cast(Any, dataset))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_DATA_SEED + 1))
    return fetch(dataset, perm[: min(EVAL_SAMPLES, n)])


@dataclass(slots=True)
class DataPosition:
    """Where a rank is in its data stream: what a checkpoint saves to resume without repeats."""

    epoch: int = 0
    offset: int = 0


class ShardedStream:
    """Batches of this rank's shard of the dataset, epoch after epoch, deterministic by seed."""

    def __init__(self, dataset: Dataset[Any], rank: int, world_size: int, seed: int, position: DataPosition | None = None) -> None:
        self.dataset = dataset
        self.size = len(cast(Any, dataset))
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.position = position or DataPosition()
        self._shard_epoch = -1
        self._shard = torch.empty(0, dtype=torch.long)

    def _shard_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._shard_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._shard = torch.randperm(self.size, generator=gen)[self.rank :: self.world_size]
            self._shard_epoch = epoch
        return self._shard

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self._shard_for(self.position.epoch)
        if batch_size > len(shard):
            raise ValueError(f"batch size {batch_size} exceeds this rank's shard of {len(shard)} samples")
        if self.position.offset + batch_size > len(shard):
            # Mutated in place: TrainState holds this same object for checkpoints.
            self.position.epoch += 1
            self.position.offset = 0
            shard = self._shard_for(self.position.epoch)
        indices = shard[self.position.offset : self.position.offset + batch_size]
        self.position.offset += batch_size
        return fetch(self.dataset, indices)

    def reshard(self, rank: int, world_size: int) -> None:
        """Follow a new world: keep the epoch and the fraction of it already consumed."""
        if (rank, world_size) == (self.rank, self.world_size):
            return
        self.position.offset = self.position.offset * self.world_size // world_size
        self.rank, self.world_size = rank, world_size
        self._shard_epoch = -1
