"""The adaptation API's pure core (sgdjob_trainer.adapt.split): per-rank shares of the global batch,
where each rank's slice lies, a new split at an agreed batch, and what a command changes or is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.split import (
    Dispenser,
    Position,
    Schedule,
    Split,
    Ticket,
    apply_command,
    batches_left,
    next_epoch,
    prefetch_lag,
    take,
)
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand


def test_a_split_gives_each_rank_its_size_and_a_smaller_world_keeps_the_ranks_it_has() -> None:
    split = Split.of(3, 32, {1: 16, 4: 8})
    assert split.sizes == (32, 16, 32) and split.total == 80
    assert [split.start(r) for r in range(3)] == [0, 32, 48]
    assert Split.of(2, 32, split.as_dict()).sizes == (32, 16)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8), st.data())
def test_weighted_ranks_average_to_the_mean_over_every_sample(sizes: list[int], data: st.DataObject) -> None:
    """DDP divides the sum of the ranks' gradients by the world size; with each rank's mean gradient
    scaled by its weight first, that is the mean over all samples of the global batch."""
    split = Split(tuple(sizes))
    grads = data.draw(st.lists(st.floats(-10, 10), min_size=len(sizes), max_size=len(sizes)))
    ddp_average = sum(split.weight(r) * g for r, g in enumerate(grads)) / split.world
    per_sample = sum(b * g for b, g in zip(sizes, grads, strict=True)) / split.total
    assert ddp_average == pytest.approx(per_sample, abs=1e-9)


def _epoch(samples: int, schedule: Schedule, world: int, pos: Position) -> tuple[list[list[range]], Position]:
    """Every rank's slices of one epoch from `pos` (a list per global batch), as the loaders cut them."""
    batches: list[list[range]] = []
    while True:
        cut = [take(pos, samples, schedule.at(pos.batch), r) for r in range(world)]
        if cut[0] is None:
            assert all(c is None for c in cut), "every rank ends the epoch at the same batch"
            return batches, next_epoch(pos)
        batches.append([c[0] for c in cut if c is not None])
        after = {c[1] for c in cut if c is not None}
        assert len(after) == 1, "every rank moves to the same position"
        pos = after.pop()


def test_the_ranks_slices_tile_each_global_batch_and_no_sample_is_read_twice_across_a_resplit() -> None:
    plain = Split.of(3, 8)
    schedule = Schedule.starting(plain).then(5, Split((12, 8, 6)), consumed=2)  # a new split from batch 5
    batches, after = _epoch(300, schedule, 3, Position())
    for k, slices in enumerate(batches):
        expected = schedule.at(k)
        assert [len(s) for s in slices] == list(expected.sizes)
        assert [s.start for s in slices[1:]] == [s.stop for s in slices[:-1]], "contiguous, rank 0 first"
    seen = [i for slices in batches for s in slices for i in s]
    assert seen == list(range(len(seen))), "the global batches read the epoch's order once, in order"
    assert [len(slices[0]) for slices in batches] == [8] * 5 + [12] * 6
    assert 300 - len(seen) < 26, "only what is left short of a global batch is dropped"
    assert after == Position(epoch=1, cursor=0, batch=len(batches))


def test_a_new_split_starts_after_every_batch_a_rank_may_have_cut_already() -> None:
    old, new = Split.of(2, 16), Split((24, 8))
    # 3 batches handed out, a loader with 2 workers x prefetch 2 has cut up to batch 6: new from 7.
    schedule = Schedule.starting(old).then(3 + prefetch_lag(2, None), new, consumed=3)
    assert [schedule.at(k) for k in (0, 3, 6, 7, 100)] == [old, old, old, new, new]
    later = schedule.then(12, Split((20, 12)), consumed=9)
    assert later.changes[0] == (7, new), "changes no batch from 9 on needs are dropped"
    assert later.at(11) == new and later.at(12) == Split((20, 12))


def test_prefetch_lag_is_what_a_torch_dataloader_cuts_ahead() -> None:
    assert prefetch_lag(0, None) == 0  # the loop's next() cuts the batch
    assert prefetch_lag(2, None) == 4 and prefetch_lag(3, 5) == 15


def test_a_resumed_position_continues_mid_epoch() -> None:
    split = Split.of(2, 10)
    pos = Position(epoch=4, cursor=60, batch=123)
    got = take(pos, 100, split, 1)
    assert got is not None and got[0] == range(70, 80) and got[1] == Position(4, 80, 124)
    assert batches_left(pos, 100, split) == 2
    assert take(Position(4, 90, 0), 100, split, 0) is None


def _command(**fields: object) -> ControlCommand:
    return ControlCommand.model_validate({"epoch": 3, "reason": "test", **fields})


def test_batch_sizes_are_applied() -> None:
    applied = apply_command(
        Split.of(2, 32), _command(batchSizes={"0": 40, "1": 24}), samples=2048, hierarchical=None, asynchronous=None
    )
    assert applied.split == Split((40, 24)) and applied.refused is None


def test_a_mode_the_api_cannot_run_is_refused_and_the_rest_still_applies() -> None:
    cannot = "adapt.start(optimizer=...) was not given"
    for mode in (SyncMode.HIERARCHICAL, SyncMode.ASYNC):
        command = _command(mode=mode.value, batchSizes={"1": 20})
        applied = apply_command(Split.of(2, 32), command, samples=2048, hierarchical=cannot, asynchronous=cannot)
        assert applied.split == Split((32, 20)) and applied.mode is None
        assert applied.refused is not None and f"mode {mode.value} refused: {cannot}" in applied.refused
    back = apply_command(Split.of(2, 32), _command(mode="sync"), 2048, hierarchical=cannot, asynchronous=cannot)
    assert back.refused is None and back.mode == SyncMode.SYNC


def test_hierarchical_and_async_are_applied_where_the_script_can_run_them() -> None:
    applied = apply_command(Split.of(4, 32), _command(mode="hierarchical", groups=[[0, 1], [2, 3]]), 2048, None, None)
    assert applied.mode == SyncMode.HIERARCHICAL and applied.refused is None and applied.split == Split.of(4, 32)
    assert apply_command(Split.of(4, 32), _command(mode="async"), 2048, "no", None).mode == SyncMode.ASYNC
    assert apply_command(Split.of(4, 32), _command(batchSizes={"0": 8}), 2048, None, None).mode is None


@given(st.lists(st.integers(1, 64), min_size=2, max_size=8), st.data())
def test_weighted_ranks_average_to_their_groups_mean_over_its_samples(sizes: list[int], data: st.DataObject) -> None:
    """In hierarchical the hook's allreduce divides by the group's size: with each rank's mean gradient
    scaled by its weight among the group, that is the mean over the group's samples only."""
    split = Split(tuple(sizes))
    group = sorted(data.draw(st.sets(st.integers(0, len(sizes) - 1), min_size=1)))
    grads = data.draw(st.lists(st.floats(-10, 10), min_size=len(sizes), max_size=len(sizes)))
    average = sum(split.weight(r, group) * grads[r] for r in group) / len(group)
    per_sample = sum(sizes[r] * grads[r] for r in group) / sum(sizes[r] for r in group)
    assert average == pytest.approx(per_sample, abs=1e-9)
    assert split.weight(group[0], [group[0]]) == 1.0, "alone in its group: its own mean gradient"


def test_batch_sizes_that_cannot_be_cut_are_refused_naming_why() -> None:
    plain = Split.of(2, 32)
    unknown = apply_command(
        plain, _command(batchSizes={"1": 20, "5": 8, "0": 0}), samples=2048, hierarchical=None, asynchronous=None
    )
    assert unknown.split == Split((32, 20)) and "unknown ranks or below 1" in (unknown.refused or "")
    too_big = apply_command(plain, _command(batchSizes={"0": 3000}), samples=2048, hierarchical=None, asynchronous=None)
    assert too_big.split == plain and "exceeds the 2048 samples of an epoch" in (too_big.refused or "")
    no_loader = apply_command(plain, _command(batchSizes={"0": 40}), samples=None, hierarchical=None, asynchronous=None)
    assert no_loader.split == plain and "without session.loader()" in (no_loader.refused or "")


def test_async_ranks_draw_from_one_queue_and_end_an_epoch_together() -> None:
    """A fast rank takes more batches; every sample once an epoch; the epoch ends for the asker when no
    batch of its size is left, the first rank to ask for the next epoch begins it, and a late rank
    asking for the old one is told it is over; `batch` counts the world's whole global batches."""
    queue = Dispenser(Position(0, 8, 1), samples=40, total=8)  # 4 ranks of 2: one global batch taken
    fast = [queue.take(0, 2) for _ in range(12)]
    assert [t.indices for t in fast[:3]] == [range(8, 10), range(10, 12), range(12, 14)]
    assert sum(len(t.indices) for t in fast) == 24 and fast[-1].world == Position(0, 32, 4)
    assert queue.take(0, 6).indices == range(32, 38) and queue.position == Position(0, 38, 4)
    over = queue.take(0, 3)
    assert not over.indices and over.world == Position(0, 38, 4), "3 samples are not left: this epoch is over"
    assert queue.take(0, 2).indices == range(38, 40), "a smaller batch still fits"
    begun = queue.take(1, 2)
    assert begun.indices == range(0, 2) and begun.world == Position(1, 2, 5)
    assert not queue.take(0, 1).indices, "a late rank in the left epoch is told it is over"
    assert Dispenser.ticket(queue.words(1, 4)) == Ticket(1, range(2, 6), Position(1, 6, 5)), "as shard 0 sends it"


def test_a_rank_met_at_a_checkpoint_where_the_others_ended_the_epoch_leaves_it_without_a_second_meeting() -> None:
    """In async the slow rank may come to a meeting from a checkpoint's call while the fast ones came to
    it from their epoch's end (the queue ran dry): that meeting ended the epoch for every rank. Relocated
    to the queue's position, the slow rank's loop ends at once, at the next epoch, and calls no meeting
    of its own, which the others, already in the next epoch, would never join (seen in CI: whole async
    epochs short of samples, the slow rank's meeting jumping the queue to the epoch after)."""
    samples, world = 32, 4
    split = Split.of(world, 2)
    queue = Dispenser(Position(0, 0, 0), samples, split.total)
    meetings: list[Position] = []
    loader = AdaptiveLoader(
        TensorDataset(torch.arange(samples)),
        rank=3,
        split=split,
        position=Position(0, 0, 0),
        shuffle=False,
        seed=0,
        lag=0,
        on_fetch=lambda: None,
        on_batch=lambda size, weight: None,
    )
    loader.dispense = queue.take
    loader.on_epoch_end = lambda: meetings.append(loader.position)
    seen = []
    for (batch,) in loader:
        seen.append(batch.tolist())
        while queue.take(0, 2).indices:  # the fast ranks empty the queue meanwhile and meet at its end
            pass
        loader.relocate(queue.position, split)  # the meeting this rank joined from its step
    assert seen == [[0, 1]] and not meetings and loader.position == Position(1, 0, queue.position.batch)
    # A meeting that leaves a batch in the epoch (a checkpoint's): the rank goes on from the queue's
    # position, takes what is left and meets the others at the end, once.
    queue = Dispenser(Position(1, 0, 4), samples, split.total)
    loader.dispense = queue.take
    taken = []
    for (batch,) in loader:
        taken.append(batch.tolist())
        if len(taken) == 1:
            for _ in range(12):  # the fast ranks take 24 samples meanwhile, 6 are left
                queue.take(1, 2)
            loader.relocate(queue.position, split)
    assert taken == [[0, 1], [26, 27], [28, 29], [30, 31]] and meetings == [Position(1, samples, 8)]
