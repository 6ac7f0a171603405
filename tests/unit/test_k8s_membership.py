"""Which worker pods a job runs and which nodes it keeps off: the policy's rescale removes the pods it
names, a restart mid-change neither duplicates nor picks another pod, and exclusions expire."""

from __future__ import annotations

import dataclasses

import pytest

from sgdjob_operator.api.models import SGDJobStatus
from sgdjob_operator.api.validation import SpecError, validate_spec
from sgdjob_operator.k8s.actuator import apply_step, driver_state, store
from sgdjob_operator.k8s.builders import JobRef, build_worker_pod
from sgdjob_operator.k8s.membership import goal_replicas, normalise, record_scale, rescaled_indices, wanted_indices
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import PodView, controller, dump_status, load_status, rfc3339
from sgdjob_operator.policy import Rescale, job_view
from sgdjob_operator.policy.driver import Observed, Step, action_for, issue
from sgdjob_trainer.wire.control import ControlCommand
from tests.unit.test_status import T0, _sample, _spec, pod, rdzv, running


def restarted(st: SGDJobStatus) -> SGDJobStatus:
    """The status as a restarted operator reads it back from the API server."""
    return load_status(dump_status(st))


def test_indices_keep_their_names_lose_the_highest_and_fill_the_lowest_free() -> None:
    assert normalise([0, 2, 3], 3) == [0, 2, 3]
    assert normalise([0, 2, 3], 2) == [0, 2]  # kubectl scale down: the highest goes
    assert normalise([0, 2, 3], 5) == [0, 1, 2, 3, 4]  # up: the free indices from the lowest
    assert rescaled_indices([0, 1, 2, 3], 3, [1]) == [0, 2, 3]
    assert rescaled_indices([0, 1, 2, 3], 4, [1]) == [0, 2, 3, 4]  # replaced: the removed name is still taken
    assert rescaled_indices([0, 2, 3], 4, []) == [0, 1, 2, 3]


def rescale_decision(st: SGDJobStatus, replicas: int, remove: tuple[int, ...], pods: list[PodView]) -> None:
    spec = _spec(replicas=4, policy={"allowedActions": ["rescale"]})
    state, _ = driver_state(st)
    samples = tuple(_sample(r) for r in range(4))
    decision = Rescale(replicas, "rank 1 slow", remove, 0.2, "n1")
    state, action = action_for(state, decision, Observed(samples), spec, job_view(spec))
    store(st, state)
    out = apply_step(st, Step(state, decision, action), T0, spec, pods)
    assert out.scale_to == replicas
    assert out.events[-1].reason == "Rescale" and "removing j-worker-1" in out.events[-1].message


def test_rescale_deletes_the_named_pod_not_the_highest_even_after_a_restart() -> None:
    pods = [pod(i, node=f"n{i}") for i in range(4)] + [rdzv()]
    st = running()
    rescale_decision(st, 3, (1,), pods)
    ctl = controller(st)
    assert ctl.worker_indices == [0, 2, 3] and (ctl.goal_replicas, ctl.scaled_replicas) == (4, 3)
    assert [e.node for e in ctl.excluded_nodes] == ["n1"]
    spec3 = _spec(replicas=3)
    plan = plan_reconcile(spec3, restarted(st), pods, generation=2, now=T0 + 1)
    assert [name for name, _ in plan.delete_pods] == ["j-worker-1"] and plan.create_workers == []
    # The pod terminates; the pods left keep their names, and nothing is recreated in its place.
    terminating = [pod(0), pod(1, deleting=True), pod(2), pod(3), rdzv()]
    again = plan_reconcile(spec3, restarted(plan.status), terminating, generation=2, now=T0 + 2)
    assert again.delete_pods == [] and again.create_workers == []
    gone = [pod(0), pod(2), pod(3), rdzv()]
    settled = plan_reconcile(spec3, restarted(again.status), gone, generation=2, now=T0 + 3)
    assert settled.delete_pods == [] and settled.create_workers == [] and settled.status.ready == "3/3"
    # Growing back to 4 fills the free index.
    grown = plan_reconcile(_spec(replicas=4), restarted(settled.status), gone, generation=3, now=T0 + 4)
    assert grown.create_workers == [1] and grown.delete_pods == []
    assert controller(grown.status).worker_indices is None  # 0..3 again: nothing to remember


def test_a_rescale_drops_the_old_worlds_batch_split_and_tells_the_new_world_plain_sizes() -> None:
    # The old world of 4 ran a split that gave its slow rank 1 a small share; that split names ranks
    # the new world of 3 hands out anew, and kept, it would run the survivors on the old shares.
    st = running()
    split = ControlCommand(epoch=0, batch_sizes={0: 40, 1: 8, 2: 40, 3: 40}, reason="rank 1 slow")
    state, _ = driver_state(st)
    store(st, issue(state, split))
    before = driver_state(st)[0].epoch
    rescale_decision(st, 3, (1,), [pod(i, node=f"n{i}") for i in range(4)] + [rdzv()])
    after, problem = driver_state(st)
    assert not problem and after.command is not None and after.epoch > before
    assert after.command.batch_sizes == {0: 32, 1: 32, 2: 32}, after.command
    assert after.policy.last_change == T0, "the policy starts over from the change"


def test_status_written_but_replicas_not_lowered_changes_nothing() -> None:
    """The operator writes status first, then spec.replicas: a restart between the two sees the
    old replicas and keeps every pod (the decision is lost, never half done)."""
    pods = [pod(i) for i in range(4)] + [rdzv()]
    st = running()
    rescale_decision(st, 3, (1,), pods)
    spec4 = _spec(replicas=4)
    plan = plan_reconcile(spec4, restarted(st), pods, generation=2, now=T0 + 1)
    assert plan.delete_pods == [] and plan.create_workers == []
    assert goal_replicas(spec4, controller(plan.status)) == 4  # spec.replicas is not what the policy set


def test_the_goal_is_the_users_replicas_until_a_person_scales() -> None:
    st = running()
    ctl = controller(st)
    record_scale(_spec(replicas=4), ctl, 3)
    assert goal_replicas(_spec(replicas=3), ctl) == 4
    record_scale(_spec(replicas=3), ctl, 2)  # a second shrink keeps the user's number
    assert goal_replicas(_spec(replicas=2), ctl) == 4
    assert goal_replicas(_spec(replicas=3), ctl) == 3  # kubectl scale to 3: that is the goal now
    assert wanted_indices(ctl, 2) == [0, 1]


def excluded(spec_policy: dict[str, float], raw: list[object], now: float) -> tuple[list[str], list[str]]:
    st = load_status({**dump_status(running()), "controller": {"excludedNodes": raw}})
    plan = plan_reconcile(_spec(policy=spec_policy), st, [pod(0), pod(1), rdzv()], generation=1, now=now)
    expired = [e.message for e in plan.events if e.reason == "NodeExclusionExpired"]
    return [e.node for e in controller(plan.status).excluded_nodes], expired


def test_exclusions_expire_after_exclude_node_seconds_with_an_event() -> None:
    entry = {"node": "bad", "since": rfc3339(T0), "until": rfc3339(T0 + 600), "reason": "rank 1 slow on it"}
    assert excluded({}, [entry], T0 + 599) == (["bad"], [])
    nodes, events = excluded({}, [entry], T0 + 600)
    assert nodes == [] and len(events) == 1 and "node bad no longer excluded" in events[0]
    assert "rank 1 slow on it" in events[0]


def test_exclusions_an_older_operator_stored_are_dated_then_expire() -> None:
    st = load_status({**dump_status(running()), "controller": {"excludedNodes": ["old"]}})
    plan = plan_reconcile(_spec(), st, [pod(0), pod(1), rdzv()], generation=1, now=T0)
    (entry,) = controller(plan.status).excluded_nodes
    assert (entry.node, entry.since, entry.until) == ("old", rfc3339(T0), rfc3339(T0 + 3600))  # the default
    later = plan_reconcile(_spec(), restarted(plan.status), [pod(0), pod(1), rdzv()], generation=1, now=T0 + 3600)
    assert controller(later.status).excluded_nodes == []
    assert [e.reason for e in later.events] == ["NodeExclusionExpired"]
    # excludeNodeSeconds 0: kept for the job's lifetime.
    assert excluded({"excludeNodeSeconds": 0}, ["old"], T0 + 10**8) == (["old"], [])


def test_an_unschedulable_replacement_is_recreated_once_its_exclusion_expires() -> None:
    """A replacement that found no node other than the one it stays off waits Pending; once that
    exclusion expires it is recreated, and may land there (the job grows back to its replicas)."""
    entry = {"node": "bad", "since": rfc3339(T0), "until": rfc3339(T0 + 600)}
    st = load_status({**dump_status(running()), "controller": {"excludedNodes": [entry]}})
    ref = JobRef(name="j", namespace="ns", uid="u")
    obj = build_worker_pod(ref, _spec(), 1, default_image="img", excluded_nodes=["bad"])
    waiting = dataclasses.replace(PodView.from_obj(obj), uid="p1")  # never scheduled: Pending, no node
    assert waiting.excluded == ("bad",) and waiting.phase == "Pending" and waiting.node is None
    pods = [pod(0, node="ok"), waiting, rdzv()]
    held = plan_reconcile(_spec(), st, pods, generation=1, now=T0 + 599)
    assert held.delete_pods == [] and held.create_workers == []
    freed = plan_reconcile(_spec(), st, pods, generation=1, now=T0 + 600)
    assert freed.delete_pods == [("j-worker-1", "exclusion of bad ended; recreated")]
    assert "NodeExclusionExpired" in [e.reason for e in freed.events]


def test_exclude_node_seconds_is_bounded_and_named() -> None:
    with pytest.raises(SpecError, match=r"spec\.policy\.excludeNodeSeconds"):
        validate_spec({"policy": {"excludeNodeSeconds": -1}})
    assert validate_spec({}).policy.exclude_node_seconds == 3600
