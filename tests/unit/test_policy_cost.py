"""Cost model, plans, statistics, state and job view."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.policy import Keep, PolicyState, RankState, Rebalance, ReplaceWorker, Rescale, SwitchMode, job_view
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.cost import CostInputs, predict_async, predict_hierarchical, predict_sync
from sgdjob_operator.policy.efficiency import Efficiency
from sgdjob_operator.policy.plans import paced_group_batches, proportional_batches, speed_groups
from sgdjob_operator.policy.stats import gap_clusters, mad, median

FREE = CommModel(latency_s=0.0, gradient_bytes=0, ps_apply_seconds=0.0)


def inputs(comm: CommModel = FREE, jitter: float = 0.0, staleness: int | None = 8) -> CostInputs:
    return CostInputs(comm, jitter, Efficiency(0.02), 4, 2, staleness, 1)


def test_sync_is_bound_by_the_slowest_and_rebalancing_recovers_the_sum() -> None:
    speeds = {0: 200.0, 1: 100.0, 2: 50.0}
    equal = {r: 30 for r in speeds}
    assert predict_sync(speeds, equal, inputs()).useful == pytest.approx(3 * 50.0)
    b = proportional_batches(speeds, 90, {r: 1000 for r in speeds})
    assert b == {0: 51, 1: 26, 2: 13}
    assert predict_sync(speeds, b, inputs()).useful == pytest.approx(90 / max(b[r] / speeds[r] for r in speeds))
    assert predict_sync(speeds, b, inputs()).useful > 0.95 * sum(speeds.values())


def test_sync_pays_allreduce_and_noise() -> None:
    comm = CommModel(latency_s=0.0, bandwidth_bytes_per_s=1e9, gradient_bytes=10**8)
    speeds, b = {r: 100.0 for r in range(4)}, {r: 10 for r in range(4)}
    step = 0.1 + comm.allreduce_s(4)
    assert comm.allreduce_s(4) == pytest.approx(2 * 3 / 4 * 0.1)
    assert predict_sync(speeds, b, inputs(comm)).throughput == pytest.approx(40 / step)
    noisy = predict_sync(speeds, b, inputs(jitter=0.1))
    assert noisy.throughput == pytest.approx(40 / (0.1 * (1 + 0.1 * math.log(4))))


def test_async_staleness_is_one_step_for_equals_and_a_stale_straggler_is_dropped() -> None:
    equal = predict_async({r: 100.0 for r in range(8)}, {r: 10 for r in range(8)}, inputs())
    assert equal.staleness == pytest.approx(1.0)
    assert equal.useful == pytest.approx(800 * 0.98)
    speeds = {r: 100.0 for r in range(8)} | {7: 10.0}
    bounded = predict_async(speeds, {r: 10 for r in range(8)}, inputs(staleness=3))
    assert bounded.throughput == pytest.approx(700.0)  # rank 7 is ~7 steps stale: dropped
    unbounded = predict_async(speeds, {r: 10 for r in range(8)}, inputs(staleness=None))
    assert unbounded.throughput == pytest.approx(710.0)


def test_async_is_capped_by_parameter_server_capacity() -> None:
    comm = CommModel(latency_s=0.0, gradient_bytes=0, ps_apply_seconds=0.01)  # 100 pushes/s
    p = predict_async({r: 100.0 for r in range(64)}, {r: 10 for r in range(64)}, inputs(comm))
    assert p.throughput == pytest.approx(100 * 10)


def test_hierarchical_runs_at_the_slowest_groups_pace_and_pays_staleness() -> None:
    speeds = {0: 200.0, 1: 200.0, 2: 100.0, 3: 100.0}
    groups = [[0, 1], [2, 3]]
    equal = predict_hierarchical(speeds, {r: 20 for r in speeds}, groups, inputs())
    assert equal.throughput == pytest.approx(80 / 0.2)
    paced = paced_group_batches(speeds, groups, 80, {r: 1000 for r in speeds})
    assert paced == {0: 27, 1: 27, 2: 13, 3: 13}
    p = predict_hierarchical(speeds, paced, groups, inputs())
    assert p.throughput > 1.4 * equal.throughput and 0 < p.efficiency < 1
    assert predict_hierarchical(speeds, paced, [[0, 1, 2, 3]], inputs()) == predict_sync(
        speeds, paced, inputs(), "hierarchical"
    )


@given(
    weights=st.dictionaries(st.integers(0, 500), st.floats(0.0, 1e4), min_size=1, max_size=60),
    per_rank=st.integers(1, 256),
    cap=st.integers(1, 1024),
)
# Found by the randomized search: the one weighted rank capped first left one sample for two ranks.
@example(weights={0: 0.0, 1: 0.0, 2: 1.0}, per_rank=84, cap=251)
def test_proportional_batches_keep_the_total_within_caps(weights: dict[int, float], per_rank: int, cap: int) -> None:
    caps = {r: cap for r in weights}
    total = per_rank * len(weights)
    out = proportional_batches(weights, total, caps)
    assert set(out) == set(weights)
    assert all(1 <= b <= cap for b in out.values())
    assert sum(out.values()) == min(total, cap * len(weights))


def test_rounding_gives_the_straggler_the_batch_that_keeps_the_slowest_step_shortest() -> None:
    # Measured at equal batches a 3x straggler reads ~2.8x slower (a fixed cost per step): its exact
    # share is 13.4 of 128. The largest fractional part would give it 14 samples, a 7 % longer step
    # for the whole world than 13 and a fast rank's 39.
    speeds = {0: 640.0, 1: 640.0, 2: 640.0, 3: 225.0}
    b = proportional_batches(speeds, 128, {r: 1000 for r in speeds})
    assert b == {0: 39, 1: 38, 2: 38, 3: 13}
    assert max(b[r] / speeds[r] for r in speeds) == pytest.approx(39 / 640)


@given(
    weights=st.lists(st.floats(1.0, 10.0), min_size=2, max_size=3),
    per_rank=st.integers(10, 20),
)
def test_proportional_batches_make_the_slowest_step_as_short_as_whole_samples_allow(
    weights: list[float], per_rank: int
) -> None:
    speeds = dict(enumerate(weights))
    total = per_rank * len(speeds)
    out = proportional_batches(speeds, total, {r: total for r in speeds})

    def splits(n: int, left: int) -> list[list[int]]:
        if n == 1:
            return [[left]] if left >= 1 else []
        return [[b, *rest] for b in range(1, left) for rest in splits(n - 1, left - b)]

    best = min(max(b / speeds[r] for r, b in enumerate(split)) for split in splits(len(speeds), total))
    assert max(out[r] / speeds[r] for r in speeds) == pytest.approx(best)


def test_statistics_and_grouping() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert mad([1.0, 1.0, 1.0, 5.0]) == 0.0 and mad([1.0, 2.0, 3.0]) == pytest.approx(1.4826)
    speeds = {0: 100.0, 1: 98.0, 2: 50.0, 3: 51.0, 4: 25.0}
    assert gap_clusters(speeds, 1.2) == [[0, 1], [3, 2], [4]]
    assert speed_groups({r: 100.0 for r in range(9)}, 1.2, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_state_round_trips_through_json() -> None:
    state = PolicyState(
        ranks={
            0: RankState(1.5, 10, 320, 2.5, 0.25, "node-a", 128.0, 2, True),
            3: RankState(1.5, 9, 288, 2.0, 0.0, None, None, 0, False),
        },
        heterogeneous=True,
        shape="singleStraggler:node-a",
        shape_streak=2,
        candidate="replace:node-a",
        candidate_streak=2,
        last_change=42.0,
        jitter=0.05,
        evaluations=7,
    )
    doc = json.loads(json.dumps(state.to_dict()))
    assert PolicyState.from_dict(doc) == state
    assert PolicyState.from_dict(None) == PolicyState() == PolicyState.from_dict({"version": 999})
    with pytest.raises(ValueError, match="malformed"):
        PolicyState.from_dict({"version": 1, "ranks": {"rank": [0], "time": ["soon"]}})
    with pytest.raises(ValueError, match="malformed"):
        PolicyState.from_dict({"version": 1, "jitter": float("nan")})


def test_job_view_from_spec() -> None:
    spec = SGDJobSpec.model_validate(
        {
            "replicas": 4,
            "minReplicas": 2,
            "maxReplicas": 6,
            "nprocPerNode": 2,
            "training": {"batchSize": 16, "async": {"staleness": None, "shards": 3}},
        }
    )
    view = job_view(spec, batch_sizes={1: 20}, replicas=3)
    assert (view.requested_mode, view.mode, view.world_size, view.min_replicas, view.max_replicas) == (
        "auto",
        "sync",
        6,
        2,
        6,
    )
    assert view.batch(1) == 20 and view.batch(0) == 16 and view.cap(0) == 64 and not view.plain
    assert view.async_staleness is None and view.ps_shards == 3
    with pytest.raises(ValueError, match="mode must be one of"):
        job_view(spec, mode="auto")


def test_decisions_serialise_for_status_and_logs() -> None:
    for d in (
        Keep("fine"),
        SwitchMode("hierarchical", "clusters", ((0, 1), (2,)), {0: 8, 1: 8, 2: 4}, 0.2),
        Rebalance({0: 40, 1: 24}, "why"),
        ReplaceWorker(3, "slow", "pod-3", "node-3"),
        Rescale(3, "slow", (3,)),
    ):
        doc = json.loads(json.dumps(d.to_dict()))
        assert doc["action"] == d.action and doc["reason"]


def test_async_under_an_adaptive_optimizer_counts_the_small_batches_noise_in_every_push() -> None:
    """A rebalanced split's batch of 1 on the slow worker: in async it pushes most often, and the servers'
    Adam divides the fast workers' pushes by its noise too, so async predicts far less than it would
    with each push's own batch."""
    adam = Efficiency(0.02, noise_scale=4.0, correlation=0.9, adaptive=True, reference_batch=96)
    ci = CostInputs(FREE, 0.0, adam, 4, 2, None, 1)
    speeds, batches = {0: 600.0, 1: 180.0, 2: 35.0}, {0: 72, 1: 23, 2: 1}
    got = predict_async(speeds, batches, ci)
    stale_only = predict_async(speeds, batches, CostInputs(FREE, 0.0, replace(adam, adaptive=False), 4, 2, None, 1))
    assert got.throughput == pytest.approx(sum(speeds.values()))
    assert got.efficiency < 0.6 * stale_only.efficiency, (got, stale_only)
    # The same split at equal batches shares nothing noisier than its own pushes.
    even = predict_async(speeds, {r: 32 for r in speeds}, ci)
    assert even.efficiency > got.efficiency
