"""Which groups a script on the adaptation API runs hierarchical in (sgdjob_trainer.adapt.hierarchy
.choose_groups): the trainer's order of sources, with the trainer's own grouping functions."""

from __future__ import annotations

from sgdjob_trainer.adapt.hierarchy import choose_groups
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
