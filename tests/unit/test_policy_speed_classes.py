"""A split of sync's batch gives ranks the measurement cannot tell apart the same batch (`cost.pooled`)."""

from __future__ import annotations

import pytest

from sgdjob_operator.policy import Evaluation, Rebalance, ReplaceWorker, Rescale, Shape
from sgdjob_operator.policy.cost import SAME_SPEED, StepTime, pooled, step_times
from tests.unit.test_policy_harness import Harness
from tests.unit.test_restart_cost import bench_like


@pytest.mark.parametrize("seed", range(10))
def test_a_noisy_bimodal_fleet_splits_equal_ranks_equally(seed: int) -> None:
    # Two pairs of equal ranks, the second pair 2x slower, every window's speeds off by up to 3 %:
    # each rank's own estimate would hand one rank of a pair a sample more than its twin, and that
    # rank would set every step. (The pairs' ratio is still read with the noise: 44/44/20/20 is a split
    # of measured speeds, not of a class's.)
    h = Harness([580.0, 580.0, 290.0, 290.0], noise=0.03, seed=seed, policy={"persistenceIntervals": 1})
    for _ in range(8):
        h.step()
    splits = [e.decision.batch_sizes for e in h.history if isinstance(e.decision, Rebalance)]
    assert splits, [e.decision.reason for e in h.history]
    assert all(s[0] == s[1] and s[2] == s[3] and sum(s.values()) == 128 for s in splits), splits


def test_only_ranks_set_apart_from_the_rest_form_a_class() -> None:
    steps = step_times({0: 100.0, 1: 102.0, 2: 50.0, 3: 51.0}, {r: 32 for r in range(4)}, {})
    out = pooled(steps, 32)
    assert out[0] == out[1] == StepTime(101.0) and out[2] == out[3] == StepTime(50.5)
    # Spread evenly, 3 % apart each: no gap sets a class apart, and a mean over ranks that differ by
    # up to 9 % would hide the slowest one's step, so every rank keeps its own estimate.
    even = step_times({r: 100.0 * (1.03**r) for r in range(4)}, {r: 32 for r in range(4)}, {})
    assert pooled(even, 32) == even
    # Ranks further apart than SAME_SPEED are two classes of one.
    apart = step_times({0: 100.0, 1: 100.0 * (1 + 2 * SAME_SPEED)}, {0: 32, 1: 32}, {})
    assert pooled(apart, 32) == apart


def _settled(h: Harness, windows: int = 4) -> Evaluation:
    for _ in range(windows):
        h.step()
    return h.history[-1]


@pytest.mark.parametrize(("fast", "slow"), [(2, 2), (4, 4)])
def test_a_slow_group_on_the_only_node_is_a_second_speed_class(fast: int, slow: int) -> None:
    # One agent with nprocPerNode ranks (every local run, every bench run): the slow ranks share their
    # node with the fast ones, so "one slow node" says nothing about them. They are a class of their own.
    h = Harness([100.0] * fast + [50.0] * slow, nproc=fast + slow, policy={"persistenceIntervals": 1})
    ev = _settled(h)
    assert ev.health.raw_shape is Shape.CLUSTERS and ev.health.shape is Shape.CLUSTERS, ev.health.summary
    assert ev.health.clusters == (tuple(range(fast)), tuple(range(fast, fast + slow)))
    assert ev.health.summary.startswith("2 speed clusters: "), ev.health.summary
    assert "single straggler" not in ev.decision.reason


def test_one_slow_rank_on_the_only_node_is_a_single_straggler() -> None:
    h = Harness([100.0, 100.0, 100.0, 50.0], nproc=4, policy={"persistenceIntervals": 1})
    ev = _settled(h)
    assert ev.health.shape is Shape.SINGLE_STRAGGLER
    assert ev.health.summary.startswith("single straggler: rank 3 on node-0 "), ev.health.summary


def test_a_slow_node_among_other_nodes_is_still_a_single_straggler() -> None:
    # Three nodes of two ranks; node-1 (ranks 2 and 3) is slow as a whole: the node is the straggler.
    h = Harness([100.0, 100.0, 50.0, 50.0, 100.0, 100.0], nproc=2, policy={"persistenceIntervals": 1})
    h.step()
    ev = h.step()
    assert ev.health.shape is Shape.SINGLE_STRAGGLER, ev.health.summary
    assert ev.health.summary.startswith("single straggler: rank 2 on node-1 "), ev.health.summary
    assert "replace" in ev.predictions  # the node's remedies are on offer


@pytest.mark.parametrize("speeds", [[100.0, 100.0, 100.0, 50.0], [100.0, 100.0, 50.0, 50.0]])
def test_no_node_is_replaced_or_removed_that_holds_every_rank(speeds: list[float]) -> None:
    # Two worker pods of two ranks each, scheduled on the same node (minReplicas 1: a replica may
    # go): replacing or removing "the slow node" would take the whole job with it.
    h = Harness(speeds, nproc=2, policy={"persistenceIntervals": 1})
    h.node_names = ["node-0"] * len(speeds)
    for _ in range(6):
        ev = h.step()
        assert not {"replace", "rescale"} & set(ev.predictions), (ev.health.summary, ev.predictions)
    assert not any(isinstance(e.decision, ReplaceWorker | Rescale) for e in h.history)


def test_a_slow_node_is_dropped_when_the_rest_of_the_fleet_reads_unequal_too() -> None:
    """A node whose step is nearly all fixed cost (a CPU quota sets it, not the batch) paces every
    split; what helps is to drop it. The other two ranks read 2.2x apart, as the real-node benchmark's
    two equal 0.8-CPU nodes did after a rebalance, so the fleet is three speed classes, not a single
    straggler: the rescale is proposed there too (it was not, and three re-splits kept ~480 samples/s)."""
    h = bench_like(20.0, 4.0, speeds=(1 / 0.0003, 1 / 0.00065, 1 / 0.0006), fixed=(0.002, 0.002, 0.2))
    for _ in range(40):
        h.step()
    dropped = [e for e in h.changes() if isinstance(e.decision, Rescale)]
    assert len(dropped) == 1 and dropped[0].decision.remove_ranks == (2,), [e.decision.reason for e in h.changes()]
    assert dropped[0].health.raw_shape is Shape.CLUSTERS
    assert len(h.speeds) == 2
    # The split made first paused nothing, so the rescale does not wait a cooldown (10 s) after it.
    split, shrink = h.changes()[0].state.last_change, dropped[0].state.last_change
    assert isinstance(h.changes()[0].decision, Rebalance) and split is not None and shrink is not None
    assert shrink - split < 10, f"split at {split} s, rescale at {shrink} s"
