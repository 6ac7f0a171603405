"""Membership changes of a local run, as pure plans: who leaves, who joins under which name."""

from __future__ import annotations

import pytest

from sgdjob_operator.local.auto import settled
from sgdjob_operator.local.fleet import MembershipChange, plan_replace, plan_rescale
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.workers.scrape import Endpoint, ScrapeResult

NODES = ["local-0", "local-1", "local-2", "local-3"]


def test_replace_stops_the_node_and_starts_one_under_a_new_name() -> None:
    assert plan_replace(NODES, "local-2", 4) == MembershipChange(("local-2",), (4,), 4)
    with pytest.raises(ValueError, match="'local-9' is not running"):
        plan_replace(NODES, "local-9", 4)


def test_rescale_down_removes_the_named_nodes_first_then_the_newest() -> None:
    assert plan_rescale(NODES, 3, ["local-1"], 4) == MembershipChange(("local-1",), (), 3)
    assert plan_rescale(NODES, 2, ["local-1"], 4) == MembershipChange(("local-1", "local-3"), (), 2)
    assert plan_rescale(NODES, 3, [], 4) == MembershipChange(("local-3",), (), 3)
    # A named node that already left is ignored; no more leave than asked.
    assert plan_rescale(NODES, 3, ["local-7", "local-0", "local-2"], 4) == MembershipChange(("local-0",), (), 3)


def test_rescale_up_adds_fresh_indices_and_never_reuses_a_name() -> None:
    assert plan_rescale(["local-0", "local-4"], 4, [], 5) == MembershipChange((), (5, 6), 4)
    assert plan_rescale(NODES, 4, ["local-0"], 4) == MembershipChange((), (), 4)
    with pytest.raises(ValueError, match="at least one node"):
        plan_rescale(NODES, 0, [], 4)


def _result(rank: int, world: int, node: str | None) -> ScrapeResult:
    sample = WorkerSample(
        rank=rank,
        time=1.0,
        steps=5,
        samples=160,
        compute_seconds=1.0,
        comm_wait_seconds=0.1,
        mode="sync",
        batch_size=32,
        node=node,
        world_size=world,
    )
    return ScrapeResult(Endpoint(f"http://127.0.0.1:{9000 + rank}", node=node), 1.0, sample, None, None)


def test_a_change_settles_when_every_rank_of_the_new_world_reports() -> None:
    old_world = [_result(r, 4, f"local-{r}") for r in range(4)]
    assert settled(old_world, 4) and not settled(old_world, 3)
    assert not settled([_result(0, 3, "local-0"), _result(1, 3, "local-1")], 3)  # rank 2 not up yet
    assert settled([_result(r, 3, "n") for r in range(3)], 3)
