"""Rebalanced sync reads one global batch per step: the samples of a step, and with them the update,
do not depend on how the batch is split among the ranks (data.ShardedStream.next_batch_of)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from sgdjob_trainer.data import ShardedStream, digits_dataset, held_out_indices

WORLD = 4
PLAIN = [32, 32, 32, 32]


def _streams(seed: int = 5) -> list[ShardedStream]:
    dataset = digits_dataset()
    held = held_out_indices(len(dataset), 256)
    return [ShardedStream(dataset, r, WORLD, seed=seed, held_out=held) for r in range(WORLD)]


def _step(streams: list[ShardedStream], split: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [s.next_batch_of(split) for s in streams]


def _samples(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[float, ...]]:
    """The step's samples as a sorted multiset (rows of x with their label)."""
    rows = [(*x.tolist(), float(y)) for xs, ys in parts for x, y in zip(xs, ys, strict=True)]
    return sorted(rows)


@pytest.mark.parametrize(
    "splits",
    [
        [[39, 38, 38, 13]],
        [[43, 43, 21, 21]],
        [[1, 60, 60, 7]],
        # a split, another split, back to equal batches, and a split again, across epoch ends
        [[39, 38, 38, 13], [43, 43, 21, 21], PLAIN, [20, 44, 44, 20]],
    ],
)
def test_every_step_reads_the_samples_plain_sync_reads_whatever_the_split(splits: list[list[int]]) -> None:
    plain, rebalanced = _streams(), _streams()
    steps = 30  # 12 global batches of 128 per epoch of digits' 1541 training samples: two epoch ends
    for step in range(steps):
        split = splits[(step // 8) % len(splits)]
        parts = _step(rebalanced, split)
        assert [len(x) for x, _ in parts] == split
        assert _samples(parts) == _samples(_step(plain, PLAIN)), f"step {step}, split {split}"
    # Both worlds are at the same place, so a resumed or rebased world continues alike.
    assert {(s.position.epoch, s.position.base + WORLD * s.position.offset) for s in rebalanced} == {
        (plain[0].position.epoch, plain[0].position.base + WORLD * plain[0].position.offset)
    }


def test_a_rebalanced_step_computes_plain_syncs_gradient() -> None:
    """What sync's weighted allreduce forms (each rank's mean gradient x its samples / all samples)
    from a split batch equals the plain split's, so a rebalance does not change the training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def world_gradient(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = sum(len(x) for x, _ in parts)
        summed = torch.zeros(sum(p.numel() for p in model.parameters()))
        for x, y in parts:
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            summed += grad * len(x) / total
        return summed

    plain, rebalanced = _streams(), _streams()
    for _ in range(3):
        expected = world_gradient(_step(plain, PLAIN))
        got = world_gradient(_step(rebalanced, [43, 43, 21, 21]))
        assert torch.allclose(got, expected, atol=1e-6)


def test_equal_batches_read_the_strided_shards_and_a_wrong_world_is_refused() -> None:
    a, b = _streams(), _streams()
    for _ in range(14):
        for sa, sb in zip(a, b, strict=True):
            assert torch.equal(sa.next_batch_of(PLAIN)[0], sb.next_batch(32)[0])
    with pytest.raises(ValueError, match="3 batch sizes for a world of 4"):
        a[0].next_batch_of([32, 32, 32])
