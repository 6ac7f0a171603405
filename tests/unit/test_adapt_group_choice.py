"""Which groups a script on the adaptation API runs hierarchical in (sgdjob_trainer.adapt.hierarchy
.choose_groups): the trainer's order of sources, with the trainer's own grouping functions; and the
gradient weight the session's loader hands out for a batch, among the world or among the group."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from sgdjob_trainer.adapt.hierarchy import choose_groups
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.split import Position, Split
from sgdjob_trainer.config import GroupBy, HierarchicalConfig

NODES = ["a", "b", "a", "b"]


def test_the_commands_groups_win_over_the_jobs_and_the_jobs_over_the_nodes() -> None:
    job = HierarchicalConfig(groups=[[0, 1], [2, 3]])
    assert choose_groups([[3, 1], [2, 0]], job, NODES, [1.0] * 4) == [[0, 2], [1, 3]]
    assert choose_groups(None, job, NODES, [1.0] * 4) == [[0, 1], [2, 3]]
    assert choose_groups(None, HierarchicalConfig(), NODES, [1.0] * 4) == [[0, 2], [1, 3]]


def test_groups_that_do_not_cover_the_world_once_fall_back_to_the_next_source() -> None:
    assert choose_groups([[0, 1], [2]], HierarchicalConfig(), NODES, [1.0] * 4) == [[0, 2], [1, 3]]
    assert choose_groups([[0, 1], [1, 2, 3]], HierarchicalConfig(), NODES, [1.0] * 4) == [[0, 2], [1, 3]]


def test_by_speed_once_every_rank_has_one_else_by_node() -> None:
    by_speed = HierarchicalConfig(group_by=GroupBy.SPEED)
    assert choose_groups(None, by_speed, NODES, [100.0, 95.0, 30.0, 100.0]) == [[0, 1, 3], [2]]
    assert choose_groups(None, by_speed, NODES, [100.0, 0.0, 30.0, 100.0]) == [[0, 2], [1, 3]]


def test_the_loader_weighs_a_batch_among_the_ranks_it_is_averaged_with_when_it_hands_it_out() -> None:
    weights: list[float] = []
    loader = AdaptiveLoader(
        TensorDataset(torch.arange(480.0)), rank=1, split=Split((8, 24, 8, 8)), position=Position(),
        shuffle=False, seed=0, lag=0, on_fetch=lambda: None, on_batch=lambda size, weight: weights.append(weight),
    )  # fmt: skip
    batches = iter(loader)
    for among in (None, (0, 1), (1,), None):
        loader.among = among  # what the session sets at a switch's step boundary
        (x,) = next(batches)
        assert len(x) == 24
    assert weights == [24 * 4 / 48, 24 * 2 / 32, 1.0, 24 * 4 / 48]
