"""Each decision path of the policy, through the synthetic job harness."""

from __future__ import annotations

import pytest

from sgdjob_operator.policy import Keep, Rebalance, ReplaceWorker, Rescale, Shape, SwitchMode
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.engine import MEASURE_WAIT_STEPS
from tests.unit.test_policy_harness import Harness

FAST, SLOW = 100.0, 33.0


def run(h: Harness, windows: int) -> None:
    for _ in range(windows):
        h.step()


def test_homogeneous_fleet_keeps_plain_sync() -> None:
    h = Harness([FAST] * 8, noise=0.05)
    run(h, 10)
    assert h.changes() == []
    assert h.history[-1].health.shape is Shape.HOMOGENEOUS
    assert "homogeneous" in h.history[-1].decision.reason


def test_persistent_straggler_is_replaced_and_its_node_excluded() -> None:
    h = Harness([FAST] * 7 + [SLOW])
    run(h, 4)
    d = h.history[3].decision  # baseline, then three windows of the straggler
    assert isinstance(d, ReplaceWorker)
    assert (d.rank, d.exclude_node, d.pod) == (7, "node-7", "pod-node-7")
    assert "rank 7" in d.reason and "3.0" in d.reason
    assert [e.decision.action for e in h.history[:3]] == ["keep"] * 3


def test_straggler_on_one_gpu_of_a_multi_gpu_node_is_replaced_without_blaming_the_node() -> None:
    speeds = [FAST] * 16
    speeds[5] = SLOW  # node-1 holds ranks 4..7; only rank 5 is slow
    h = Harness(speeds, nproc=4)
    run(h, 4)
    d = h.history[3].decision
    assert isinstance(d, ReplaceWorker) and d.rank == 5 and d.exclude_node is None


def test_straggler_without_replacement_allowed_is_removed_by_rescale() -> None:
    h = Harness([FAST] * 7 + [SLOW], policy={"allowedActions": ["rescale"]}, min_replicas=6)
    run(h, 4)
    d = h.history[3].decision
    assert isinstance(d, Rescale)
    assert d.replicas == 7 and d.remove_ranks == (7,)


def test_a_shrunk_job_grows_back_once_healthy_after_the_cooldown_and_then_stays() -> None:
    h = Harness([FAST] * 7 + [SLOW], policy={"allowedActions": ["rescale"], "cooldownSeconds": 90}, min_replicas=6)
    run(h, 4)
    shrink = h.history[3]
    assert isinstance(shrink.decision, Rescale) and shrink.decision.remove_ranks == (7,)
    assert shrink.decision.exclude_node == "node-7"  # one rank per node: the node is to blame
    run(h, 20)
    grow, *rest = h.changes()[1:]
    assert isinstance(grow.decision, Rescale) and grow.decision.replicas == 8 and grow.decision.remove_ranks == ()
    assert "grow to 8 nodes" in grow.decision.reason and grow.decision.predicted_gain > 0.1
    assert grow.state.last_change is not None and grow.state.last_change - 30.0 >= 90  # after the cooldown
    waited = [e.decision.reason for e in h.history[4:] if "cooldown" in e.decision.reason]
    assert waited and all("grow to 8 nodes" in w for w in waited)
    assert rest == [] and len(h.speeds) == 8  # grown back, and no flapping after it


def test_replacement_needs_elastic_room_else_rebalance() -> None:
    h = Harness([FAST] * 7 + [SLOW], min_replicas=8)
    run(h, 4)
    assert not any(isinstance(e.decision, ReplaceWorker) for e in h.history)
    assert isinstance(h.history[1].decision, Rebalance)  # +177 %: made at once (test_policy_fast_split)
    batches = h.history[1].decision.batch_sizes
    assert sum(batches.values()) == 8 * 32 and batches[7] < batches[0]


def test_speed_clusters_rebalance_when_communication_is_cheap() -> None:
    h = Harness([200.0] * 4 + [100.0] * 4)
    run(h, 6)
    changes = h.changes()
    assert len(changes) == 1 and isinstance(changes[0].decision, Rebalance)
    # +49 %: made on the first window that shows it (test_policy_fast_split)
    assert changes[0].health.raw_shape is Shape.CLUSTERS and "made at once" in changes[0].decision.reason
    batches = changes[0].decision.batch_sizes
    assert batches[0] == pytest.approx(2 * batches[7], abs=1)


def test_speed_clusters_with_heavy_step_noise_favour_hierarchical() -> None:
    # At 256 ranks with large per-step noise, a sync step waits for the noisiest of 256; groups
    # of 16 wait for the noisiest of 16. The policy learns the noise from sync's waits.
    # The parameter servers are slow (2 ms of work per push), so async is no way out here. (Hierarchical
    # predicts 16 % more than the split, so the split's +49 % is not made at once in front of it.)
    h = Harness(
        [200.0] * 128 + [100.0] * 128,
        jitter=0.25,
        nproc=8,
        comm=CommModel(latency_s=0.0, gradient_bytes=0, ps_apply_seconds=0.002),
    )
    run(h, 6)
    changes = h.changes()
    assert len(changes) == 1
    d = changes[0].decision
    assert isinstance(d, SwitchMode) and d.mode == "hierarchical" and d.groups is not None
    for group in d.groups:  # groups never mix the clusters
        assert len({h.speeds[r] for r in group}) == 1
    assert d.batch_sizes is not None and d.batch_sizes[0] > d.batch_sizes[200]


def test_dispersed_speeds_choose_the_better_of_async_and_rebalanced_sync() -> None:
    speeds = [60.0 + 10 * i for i in range(8)] * 2
    cheap = Harness(list(speeds), comm=CommModel(latency_s=0.0, gradient_bytes=0, ps_apply_seconds=0.0))
    run(cheap, 6)
    assert cheap.history[3].health.shape is Shape.DISPERSED
    assert isinstance(cheap.changes()[0].decision, Rebalance)  # sync has no staleness to pay
    # Very high message latency: every allreduce (any group size) costs more than a push and
    # pull to the parameter servers, so async wins.
    pricey = Harness(list(speeds), comm=CommModel(latency_s=0.2, gradient_bytes=0, ps_apply_seconds=0.0))
    run(pricey, 14)
    # (A new split of sync's batch, +10 % once the speeds rest on ten steps, may come first: it
    # pauses nothing while async waits for its statistics.)
    ev = next(e for e in pricey.changes() if not isinstance(e.decision, Rebalance))
    assert isinstance(ev.decision, SwitchMode) and ev.decision.mode == "async"
    # These trainers report no gradient statistics: async, a stale mode, waited until the ranks had
    # made MEASURE_WAIT_STEPS steps (4 per interval here) and then went on the stalenessPenalty prior.
    first = pricey.history.index(ev)
    assert first * 4 >= MEASURE_WAIT_STEPS
    waiting = f"stale modes wait for {MEASURE_WAIT_STEPS} steps of measured gradient statistics (25 so far)"
    assert any(waiting in e.decision.reason for e in pricey.history[:first])
    assert ev.predictions["async"] == max(ev.predictions.values())


def test_fixed_mode_never_switches_mode() -> None:
    h = Harness([200.0] * 4 + [100.0] * 4, mode="sync", jitter=0.2)
    run(h, 8)
    assert all(not isinstance(e.decision, SwitchMode) for e in h.history)
    assert any(isinstance(e.decision, Rebalance) for e in h.history)  # rebalancing stays sync
    fixed_async = Harness([200.0] * 4 + [100.0] * 4, mode="async")
    run(fixed_async, 8)
    assert fixed_async.changes() == []  # async cannot rebalance, may not switch


def test_actions_not_allowed_are_never_taken() -> None:
    h = Harness([FAST] * 7 + [SLOW], policy={"allowedActions": []})
    run(h, 8)
    assert h.changes() == []
    assert "no allowed action" in h.history[-1].decision.reason


def test_when_every_allowed_change_is_stale_the_reason_says_they_wait_not_that_none_applies() -> None:
    h = Harness([FAST] * 7 + [SLOW], policy={"allowedActions": ["switchMode"]}, batch=64)  # 5 steps an interval
    run(h, 4)
    reason = h.history[-1].decision.reason
    assert "every allowed change has stale gradients; stale modes wait for" in reason, reason
    assert "no allowed action" not in reason


def test_cooldown_delays_a_second_change_but_not_a_new_split_of_the_batch() -> None:
    clusters = [200.0] * 4 + [100.0] * 4
    for actions, waits in ((["replaceWorker", "switchMode"], True), (["replaceWorker", "rebalance"], False)):
        h = Harness([FAST] * 7 + [SLOW], policy={"cooldownSeconds": 120, "allowedActions": actions})
        run(h, 4)
        assert isinstance(h.history[3].decision, ReplaceWorker)
        for _ in range(14):
            h.step(clusters)
        acted = [e for e in h.history[4:] if e.decision.action != "keep"]
        assert acted and acted[0].state.last_change is not None
        waited = [e.decision.reason for e in h.history[4:] if "cooldown" in e.decision.reason]
        if waits:  # a mode switch pauses the job: it waits out the cooldown and says so
            assert waited and isinstance(acted[0].decision, SwitchMode)
            assert acted[0].state.last_change - 30.0 >= 120
        else:  # a rebalance is applied at a step boundary: it waits only for its persistence
            assert not waited and isinstance(acted[0].decision, Rebalance)
            assert acted[0].state.last_change - 30.0 < 120


def test_returns_to_plain_sync_when_speeds_equalise() -> None:
    h = Harness([FAST] * 8, start_mode="async")
    run(h, 5)
    d = h.changes()[0].decision
    assert isinstance(d, SwitchMode) and d.mode == "sync"
    rebalanced = Harness([FAST] * 8, start_batches={0: 40, 1: 24})
    run(rebalanced, 5)
    d2 = rebalanced.changes()[0].decision
    assert isinstance(d2, Rebalance) and set(d2.batch_sizes.values()) == {32}


def test_batches_follow_a_straggler_that_goes_and_comes_back_without_waiting_out_the_cooldown() -> None:
    h = Harness([FAST] * 7 + [SLOW], policy={"cooldownSeconds": 600, "allowedActions": ["rebalance"]})
    run(h, 4)
    first = h.changes()
    assert len(first) == 1 and isinstance(first[0].decision, Rebalance)
    for _ in range(5):
        h.step([FAST] * 8)  # the straggler is gone
    back = h.changes()[1:]
    assert back and isinstance(back[0].decision, Rebalance) and set(back[0].decision.batch_sizes.values()) == {32}
    assert back[0].state.last_change is not None and back[0].state.last_change - 30.0 < 600
    # A straggler that comes back is rebalanced again at once: a new split of the batch pauses
    # nothing, so it does not wait out the cooldown either (only its persistence).
    for _ in range(5):
        h.step([FAST] * 7 + [SLOW])
    again = h.changes()[2:]
    assert len(again) == 1 and isinstance(again[0].decision, Rebalance)
    assert again[0].decision.batch_sizes[7] < again[0].decision.batch_sizes[0]
    assert again[0].state.last_change is not None and again[0].state.last_change - 30.0 < 600


def test_transient_slowdown_never_flips_the_job() -> None:
    h = Harness([FAST] * 8)
    run(h, 3)
    slow = [FAST] * 7 + [SLOW]
    seen = [h.step(slow), h.step(slow), h.step([FAST] * 8), h.step(slow), h.step([FAST] * 8)]
    assert h.changes() == []
    assert seen[0].health.shape is Shape.TRANSIENT and seen[0].health.suspects == (7,)


def test_hysteresis_keeps_a_straggler_flagged_until_it_recovers() -> None:
    h = Harness([FAST] * 8, policy={"allowedActions": []})
    h.step()
    h.step([FAST] * 7 + [FAST / 2])  # 2x: flagged
    h.step([FAST] * 7 + [FAST / 1.3])  # 1.3x: between recover (1.2) and threshold (1.5): still flagged
    assert h.history[-1].health.ranks[7].flagged
    h.step([FAST] * 7 + [FAST / 1.1])  # below recover: cleared
    assert not h.history[-1].health.ranks[7].flagged


def test_counter_reset_is_a_restart_not_a_slow_rank() -> None:
    h = Harness([FAST] * 8)
    run(h, 3)
    h.counters[2] = [0, 0, 0.0, 0.0]  # process 2 restarted between scrapes
    ev = h.step()
    assert ev.health.restarted == (2,)
    assert not ev.health.ranks[2].flagged and ev.health.ranks[2].measured is False
    assert ev.decision.action == "keep"
    assert h.step().health.ranks[2].measured


def test_missing_and_stalled_ranks() -> None:
    h = Harness([FAST] * 4)
    run(h, 2)
    h.now += 10
    view_samples = [s for s in h.samples() if s.rank != 3]
    from sgdjob_operator.policy import PolicyState, evaluate, job_view

    view = job_view(h.spec, mode="sync")
    ev = evaluate(PolicyState.from_dict(h.state_doc), view_samples, view, h.now)
    assert ev.health.missing == (3,)
    assert isinstance(ev.decision, Keep)
    # Nobody advanced (a stalled job): no rates at all, nothing decided.
    stalled = evaluate(ev.state, view_samples, view, h.now + 10)
    assert stalled.health.shape is Shape.UNKNOWN and "waiting for rates" in stalled.decision.reason


def test_evaluate_is_deterministic_and_does_not_touch_its_inputs() -> None:
    h = Harness([FAST] * 7 + [SLOW])
    run(h, 2)
    from sgdjob_operator.policy import PolicyState, evaluate, job_view

    state = PolicyState.from_dict(h.state_doc)
    before = state.to_dict()
    samples = h.samples()
    view = job_view(h.spec)
    a = evaluate(state, samples, view, 100.0)
    b = evaluate(state, samples, view, 100.0)
    assert a.decision == b.decision and a.state.to_dict() == b.state.to_dict()
    assert state.to_dict() == before
