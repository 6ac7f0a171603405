"""Pure status, reconciliation planning and decision application: no cluster, no clock."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from sgdjob_operator.api.models import MAX_DECISIONS, Phase, SGDJobStatus
from sgdjob_operator.api.validation import validate_spec
from sgdjob_operator.k8s.actuator import Outcome, apply_step, driver_state, store
from sgdjob_operator.k8s.observe import Observation, command_to_push, record_observation
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import (
    PodView,
    controller,
    dump_status,
    load_status,
    mark_invalid,
    pod_changed,
    record_decision,
    rfc3339,
)
from sgdjob_operator.policy import Decision, Keep, Rebalance, ReplaceWorker, Rescale, SwitchMode, WorkerSample, job_view
from sgdjob_operator.policy.driver import Observed, Refused, Step, action_for
from sgdjob_operator.workers.scrape import Endpoint
from sgdjob_trainer.wire.worker_status import TARGET_REACHED, Termination, WorkerStatus, parse_termination

T0 = 1_800_000_000.0


def _spec(**extra: Any) -> Any:
    return validate_spec({"replicas": 2, "minReplicas": 1, "maxReplicas": 4, **extra})


def pod(
    index: int | None,
    phase: str = "Running",
    *,
    ready: bool = True,
    uid: str = "",
    node: str | None = None,
    deleting: bool = False,
    reason: str = "",
    role: str = "worker",
) -> PodView:
    name = f"j-worker-{index}" if role == "worker" else "j-rdzv"
    return PodView(
        name,
        uid or f"uid-{name}",
        role,
        index,
        phase,
        ready,
        "10.0.0.1",
        node,
        deleting,
        1 if phase == "Failed" else None,
        reason,
    )


def rdzv() -> PodView:
    return pod(None, role="rendezvous")


def running(st: SGDJobStatus | None = None) -> SGDJobStatus:
    st = st or SGDJobStatus()
    st.start_time = rfc3339(T0)
    st.phase = Phase.RUNNING
    st.target_mode = "sync"
    return st


def test_pod_view_reads_what_a_kubelet_reports() -> None:
    obj = {
        "metadata": {
            "name": "j-worker-3",
            "uid": "u",
            "labels": {"sgdjob.dev/replica-index": "3", "sgdjob.dev/role": "worker"},
            "deletionTimestamp": "x",
        },
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Failed",
            "podIP": "10.1.1.1",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
        },
    }
    view = PodView.from_obj(obj)
    assert (view.index, view.phase, view.ready, view.ip, view.node, view.deleting, view.exit_code, view.reason) == (
        3,
        "Failed",
        False,
        "10.1.1.1",
        "n1",
        True,
        137,
        "OOMKilled",
    )
    assert not view.active


def test_new_job_creates_every_worker_and_the_rendezvous() -> None:
    plan = plan_reconcile(_spec(), SGDJobStatus(), [], generation=4, now=T0)
    assert plan.create_workers == [0, 1] and plan.create_rdzv and not plan.delete_pods
    st = plan.status
    assert st.phase is Phase.PENDING and st.ready == "0/2" and st.target_mode == "sync" and st.observed_generation == 4
    assert [(c.type, c.status) for c in st.conditions] == [("Created", "True"), ("Running", "False")]


def test_pending_to_running_to_adapting_with_stable_transition_times() -> None:
    spec = _spec()
    plan = plan_reconcile(spec, SGDJobStatus(), [pod(0), pod(1, "Pending", ready=False), rdzv()], generation=1, now=T0)
    assert plan.status.phase is Phase.RUNNING or plan.status.phase is Phase.ADAPTING  # minReplicas 1 ready: started
    assert plan.status.start_time == rfc3339(T0)
    plan = plan_reconcile(spec, plan.status, [pod(0), pod(1), rdzv()], generation=1, now=T0 + 5)
    assert (
        plan.status.phase is Phase.RUNNING
        and plan.status.ready == "2/2"
        and "Running" in [e.reason for e in plan.events]
    )
    running_since = {c.type: c.last_transition_time for c in plan.status.conditions}["Running"]
    plan = plan_reconcile(spec, plan.status, [pod(0), pod(1), rdzv()], generation=1, now=T0 + 50)
    assert {c.type: c.last_transition_time for c in plan.status.conditions}["Running"] == running_since
    assert not plan.events  # nothing changed: nothing to say
    st = plan.status
    st.mode, st.target_mode = "sync", "async"
    plan = plan_reconcile(spec, st, [pod(0), pod(1), rdzv()], generation=1, now=T0 + 60)
    assert plan.status.phase is Phase.ADAPTING and "switching mode" in plan.status.message
    assert _adapting(plan.status) == ("True", "SwitchingMode")


def _adapting(st: SGDJobStatus) -> tuple[str, str]:
    c = {c.type: c for c in st.conditions}.get("Adapting")  # listed once it has been true
    return (c.status, c.reason) if c is not None else ("", "")


def test_the_adapting_reason_says_what_the_job_waits_for() -> None:
    spec = _spec()
    plan = plan_reconcile(spec, running(), [pod(0), pod(1), rdzv()], generation=1, now=T0)
    assert plan.status.phase is Phase.RUNNING and _adapting(plan.status) == ("", "")
    # A worker that stopped being ready with nothing changed by the operator (its node stopped
    # reporting, say): the job waits for workers, it is not applying a change.
    plan = plan_reconcile(spec, plan.status, [pod(0), pod(1, ready=False), rdzv()], generation=1, now=T0 + 5)
    assert plan.status.phase is Phase.ADAPTING and _adapting(plan.status) == ("True", "WorkersNotReady")
    assert plan.status.message == "1 of 2 workers ready"
    plan = plan_reconcile(spec, plan.status, [pod(0), pod(1), rdzv()], generation=1, now=T0 + 7)
    assert plan.status.phase is Phase.RUNNING and _adapting(plan.status) == ("False", "Stable")
    plan = plan_reconcile(spec, plan.status, [pod(0), pod(1, deleting=True), rdzv()], generation=1, now=T0 + 10)
    assert _adapting(plan.status) == ("True", "PodsTerminating")
    plan = plan_reconcile(_spec(replicas=3), plan.status, [pod(0), pod(1), rdzv()], generation=2, now=T0 + 15)
    assert _adapting(plan.status) == ("True", "PodsMissing") and plan.status.message == "2 of 3 worker pods exist"
    # The third pod exists but the scheduler finds no node for it: the scheduler's reason is shown.
    why = "0/3 nodes are available: 3 node(s) didn't match"
    waiting = dataclasses.replace(pod(2, "Pending", ready=False), unschedulable=why)
    plan = plan_reconcile(_spec(replicas=3), plan.status, [pod(0), pod(1), waiting, rdzv()], generation=2, now=T0 + 20)
    assert _adapting(plan.status) == ("True", "WorkersUnschedulable")
    assert plan.status.message == (
        "2 of 3 workers ready; j-worker-2 unschedulable: 0/3 nodes are available: 3 node(s) didn't match"
    )


def test_a_pods_unschedulable_condition_is_read() -> None:
    obj = {
        "metadata": {"name": "j-worker-2", "uid": "u", "labels": {}},
        "spec": {},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes fit",
                    "lastTransitionTime": rfc3339(T0),
                }
            ],
        },
    }
    assert PodView.from_obj(obj).unschedulable == "0/3 nodes fit"
    assert PodView.from_obj(obj).unschedulable_since == T0
    obj["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
    assert PodView.from_obj(obj).unschedulable == ""


def test_scale_and_excluded_nodes_change_membership() -> None:
    st = load_status({**dump_status(running()), "controller": {"excludedNodes": ["bad"]}})  # an older operator's
    pods = [pod(0, node="ok"), pod(1, node="bad"), pod(2, node="ok"), pod(3, deleting=True), rdzv()]
    plan = plan_reconcile(_spec(replicas=2), st, pods, generation=1, now=T0)
    assert sorted(plan.delete_pods) == [
        ("j-worker-1", "node bad excluded for this job; replaced"),
        ("j-worker-2", "scaled down to 2 replicas"),
    ]
    assert plan.create_workers == []  # index 1 is still held until its pod is gone
    plan = plan_reconcile(_spec(replicas=4), running(), [pod(0), pod(1), rdzv()], generation=2, now=T0)
    assert plan.create_workers == [2, 3] and plan.status.phase is Phase.ADAPTING


def test_failures_count_once_and_infrastructure_is_free() -> None:
    spec = _spec(runPolicy={"backoffLimit": 1})
    pods = [pod(0, "Failed", uid="a"), pod(1), rdzv()]
    plan = plan_reconcile(spec, running(), pods, generation=1, now=T0)
    assert plan.status.restarts == 1 and ("j-worker-0", "failed; recreated") in plan.delete_pods
    assert [e.reason for e in plan.events].count("WorkerFailed") == 1
    again = plan_reconcile(spec, plan.status, pods, generation=1, now=T0 + 1)  # same failed pod seen again
    assert again.status.restarts == 1 and "WorkerFailed" not in [e.reason for e in again.events]
    evicted = plan_reconcile(
        spec, again.status, [pod(0, "Failed", uid="b", reason="Evicted"), pod(1), rdzv()], generation=1, now=T0 + 2
    )
    assert evicted.status.restarts == 1 and evicted.status.phase is not Phase.FAILED
    # Deleted while running (kubectl delete, a drain): stopped on request, not a failure of its own.
    deleted = plan_reconcile(
        spec, evicted.status, [pod(0, "Failed", uid="d", deleting=True), pod(1), rdzv()], generation=1, now=T0 + 2
    )
    assert deleted.status.restarts == 1 and deleted.status.phase is not Phase.FAILED
    assert any(
        "deleted while it ran" in e.message and "not counted" in e.message
        for e in deleted.events
        if e.reason == "WorkerFailed"
    )
    final = plan_reconcile(spec, deleted.status, [pod(0, "Failed", uid="c"), pod(1), rdzv()], generation=1, now=T0 + 3)
    assert final.status.phase is Phase.FAILED and final.status.restarts == 2
    failed = {c.type: c for c in final.status.conditions}["Failed"]
    assert failed.reason == "BackoffLimitExceeded" and "j-worker-0" in failed.message
    # cleanPodPolicy Running: the running worker and the rendezvous go; the failed pod stays for its logs
    assert {n for n, _ in final.delete_pods} == {"j-worker-1", "j-rdzv"}


def test_success_deadline_and_ttl() -> None:
    spec = _spec(runPolicy={"ttlSecondsAfterFinished": 60, "cleanPodPolicy": "None"})
    plan = plan_reconcile(spec, running(), [pod(0, "Succeeded"), pod(1), rdzv()], generation=1, now=T0)
    assert plan.status.phase is Phase.RUNNING and not plan.create_workers  # one done: wait for the other, start nothing
    plan = plan_reconcile(
        spec, plan.status, [pod(0, "Succeeded"), pod(1, "Succeeded"), rdzv()], generation=1, now=T0 + 1
    )
    assert (
        plan.status.phase is Phase.SUCCEEDED
        and plan.status.completion_time
        and not plan.delete_pods
        and not plan.delete_job
    )
    assert plan.status.step == spec.training.steps  # the final step, not the last scrape's
    assert {c.type: c.reason for c in plan.status.conditions}["Succeeded"] == "WorkersSucceeded"
    later = plan_reconcile(spec, plan.status, [], generation=1, now=T0 + 62)
    assert later.delete_job and later.status.phase is Phase.SUCCEEDED
    deadline = _spec(runPolicy={"activeDeadlineSeconds": 10})
    late = plan_reconcile(deadline, running(), [pod(0), pod(1), rdzv()], generation=1, now=T0 + 11)
    assert (
        late.status.phase is Phase.FAILED
        and {c.type: c.reason for c in late.status.conditions}["Failed"] == "DeadlineExceeded"
    )
    assert {n for n, _ in late.delete_pods} == {"j-worker-0", "j-worker-1", "j-rdzv"}


def test_suspend_removes_pods_and_resume_starts_over() -> None:
    spec = _spec(runPolicy={"suspend": True})
    plan = plan_reconcile(spec, running(), [pod(0), pod(1), rdzv()], generation=2, now=T0)
    assert plan.status.phase is Phase.SUSPENDED and plan.status.start_time is None and len(plan.delete_pods) == 3
    assert [e.reason for e in plan.events] == ["Suspended"]
    resumed = plan_reconcile(_spec(), plan.status, [], generation=3, now=T0 + 5)
    assert (
        resumed.status.phase is Phase.PENDING
        and resumed.create_workers == [0, 1]
        and "Resumed" in [e.reason for e in resumed.events]
    )


def test_a_resume_waits_until_every_pod_of_the_suspension_has_ended() -> None:
    """An agent still stopping would join the new store's first round: nothing starts while any
    suspended pod, the store's included, is terminating, and the job says what it waits for."""
    pods = [pod(0), pod(1), rdzv()]
    suspended = plan_reconcile(_spec(runPolicy={"suspend": True}), running(), pods, generation=2, now=T0)
    ending = [pod(1, deleting=True), dataclasses.replace(rdzv(), deleting=True)]
    waiting = plan_reconcile(_spec(), suspended.status, ending, generation=3, now=T0 + 5)
    assert waiting.status.phase is Phase.SUSPENDED and not waiting.create_workers and not waiting.create_rdzv
    assert not waiting.events and "j-worker-1" in waiting.status.message and "j-rdzv" in waiting.status.message
    resumed = plan_reconcile(_spec(), waiting.status, [], generation=3, now=T0 + 8)
    assert resumed.status.phase is Phase.PENDING and resumed.create_workers == [0, 1] and resumed.create_rdzv
    assert "Resumed" in [e.reason for e in resumed.events]


def test_fixed_mode_change_is_a_recorded_command() -> None:
    plan = plan_reconcile(_spec(mode="async"), running(), [pod(0), pod(1), rdzv()], generation=2, now=T0)
    st = plan.status
    assert st.target_mode == "async" and controller(st).command is not None and controller(st).command["epoch"] == 1
    assert st.decisions[-1].action == "switchMode" and "spec.mode" in st.decisions[-1].reason


def test_decision_history_is_bounded_and_status_round_trips() -> None:
    st = SGDJobStatus()
    for i in range(MAX_DECISIONS + 5):
        record_decision(st, T0 + i, "rescale", f"r{i}", replicas=2)
    assert len(st.decisions) == MAX_DECISIONS and st.decisions[0].reason == "r5"
    raw = json.loads(json.dumps(dump_status(st)))
    assert load_status(raw).decisions == st.decisions
    assert load_status({**raw, "phase": "Bogus", "future": 1}).decisions == st.decisions  # bad parts dropped, not fatal


def test_invalid_spec_marks_failed_once() -> None:
    st = SGDJobStatus()
    events = mark_invalid(st, ["spec.minReplicas: must be <= replicas"], T0)
    assert st.phase is Phase.FAILED and events[0].reason == "InvalidSpec" and "spec.minReplicas" in st.message
    assert mark_invalid(st, ["spec.minReplicas: must be <= replicas"], T0 + 1) == []


def _sample(rank: int, mode: str = "sync") -> WorkerSample:
    return WorkerSample(
        rank=rank,
        time=T0,
        steps=10,
        samples=320,
        compute_seconds=1.0,
        comm_wait_seconds=0.1,
        mode=mode,
        batch_size=32,
        pod=f"j-worker-{rank}",
        node=f"n{rank}",
    )


def apply_decision(st: SGDJobStatus, spec: Any, decision: Decision, samples: tuple[WorkerSample, ...] = ()) -> Outcome:
    """What the operator does with `decision`, as the driver would have returned it."""
    state, _ = driver_state(st)
    state, action = action_for(state, decision, Observed(samples), spec, job_view(spec))
    store(st, state)
    return apply_step(st, Step(state, decision, action), T0, spec)


def test_switch_is_recorded_then_pushed_until_applied() -> None:
    spec, st = _spec(), running()
    out = apply_decision(st, spec, SwitchMode(mode="async", reason="straggler"))
    assert out.applied == "switchMode" and out.config_changed and st.target_mode == "async"
    assert (
        controller(st).command == {"epoch": 1, "mode": "async", "reason": "straggler"}
        and st.decisions[-1].mode == "async"
    )
    control = Endpoint("http://10.0.0.1:9400")
    unapplied = Observation(T0, (_sample(0), _sample(1)), {}, control, control_epoch=0)
    command = command_to_push(st, unapplied)
    assert command is not None and command.epoch == 1 and command.mode is not None and command.mode.value == "async"
    assert command_to_push(st, Observation(T0, (_sample(0, "async"),), {}, control, control_epoch=1)) is None
    assert (
        command_to_push(st, Observation(T0, (_sample(0), _sample(1)), {}, control, control_epoch=None)) is not None
    )  # no epoch: mode decides
    assert Observation(T0, (_sample(0, "sync"), _sample(1, "async")), {}).mode is None  # mid-switch


def test_validation_and_a_reached_target_are_kept_and_end_the_job_as_target_reached() -> None:
    spec = _spec(training={"dataset": "digits", "target": {"metric": "accuracy", "value": 0.9}})
    st = running()
    before = WorkerStatus(rank=0, step=40, validation_loss=1.25, validation_accuracy=0.5, validation_step=40)
    assert record_observation(st, Observation(T0, (_sample(0),), {}, job_step=40, control_status=before), None) == []
    assert (st.validation_loss, st.validation_accuracy, st.target_step) == (1.25, 0.5, None)
    reached = before.model_copy(
        update={"validation_accuracy": 0.92, "target_step": 60, "time_to_target_s": 12.5, "end_reason": "TargetReached"}
    )
    events = record_observation(st, Observation(T0, (_sample(0),), {}, job_step=61, control_status=reached), None)
    assert [e.reason for e in events] == ["TargetReached"]
    assert (st.validation_accuracy, st.target_step, st.time_to_target_seconds) == (0.92, 60, 12.5)
    # The workers have exited 0 before spec.training.steps: the kept record says why.
    plan = plan_reconcile(spec, st, [pod(0, "Succeeded"), pod(1, "Succeeded"), rdzv()], generation=1, now=T0 + 1)
    assert plan.status.phase is Phase.SUCCEEDED and plan.status.step == 61 < spec.training.steps
    assert {c.type: c.reason for c in plan.status.conditions}["Succeeded"] == "TargetReached"
    assert [e.reason for e in plan.events] == ["TargetReached"]
    assert load_status(dump_status(plan.status)).time_to_target_seconds == 12.5


def test_a_target_reached_after_the_last_scrape_is_read_from_rank_0s_termination_message() -> None:
    spec = _spec(training={"dataset": "digits", "target": {"metric": "accuracy", "value": 0.9}})
    st = running()
    record_observation(st, Observation(T0, (_sample(0),), {}, job_step=40), None)
    message = Termination(step=61, end_reason=TARGET_REACHED, target_step=60, time_to_target_s=12.5)
    rank0 = dataclasses.replace(pod(0, "Succeeded"), message=json.dumps(message.document()))
    logs = dataclasses.replace(pod(1, "Succeeded"), message="some log line the kubelet kept")
    plan = plan_reconcile(spec, st, [logs, rank0, rdzv()], generation=1, now=T0 + 1)
    assert plan.status.phase is Phase.SUCCEEDED and plan.status.target_step == 60
    assert {c.type: c.reason for c in plan.status.conditions}["Succeeded"] == "TargetReached"
    assert plan.status.step == 60 and plan.status.time_to_target_seconds == 12.5
    # Without the message (an older trainer, or a step limit), success is the step limit's.
    plain = plan_reconcile(spec, running(), [pod(0, "Succeeded"), rdzv()], generation=1, now=T0 + 1)
    assert {c.type: c.reason for c in plain.status.conditions}["Succeeded"] == "WorkersSucceeded"
    assert parse_termination("Traceback (most recent call last):") is None


def test_step_is_the_jobs_step_after_a_resume() -> None:
    """Per-process step counters restart at 0 with the process; rank 0's /status step is the job's."""
    st = running()
    record_observation(st, Observation(T0, (_sample(0), _sample(1)), {}, job_step=137), None)
    assert st.step == 137
    record_observation(st, Observation(T0, (_sample(0), _sample(1)), {}), None)
    assert st.step == 10  # without rank 0's /status: the counters


def test_a_hung_worker_is_replaced_with_a_warning_naming_rank_and_pod() -> None:
    spec, st = _spec(), running()
    hung = ReplaceWorker(rank=2, reason="hang: rank 2 (pod j-worker-2) has finished no step for 301s", hung=True)
    out = apply_decision(st, spec, hung, (_sample(2),))
    assert out.delete_pod == "j-worker-2"
    event = out.events[-1]
    assert (event.type, event.reason) == ("Warning", "WorkerHung") and "rank 2 (pod j-worker-2)" in event.message
    slow = apply_decision(running(), spec, ReplaceWorker(rank=1, reason="slow pod"), (_sample(1),))
    assert (slow.events[-1].type, slow.events[-1].reason) == ("Normal", "ReplaceWorker")


def test_the_worker_hung_condition_names_rank_and_pod_until_the_job_passes_the_step_it_hung_at() -> None:
    spec, st = _spec(), running()
    pods = [pod(0), pod(1), rdzv()]
    st.step = 120
    apply_decision(
        st, spec, ReplaceWorker(rank=1, reason="hang: rank 1 finished no step for 300s", hung=True), (_sample(1),)
    )

    def hung_condition(status: SGDJobStatus) -> Any:
        return {c.type: c for c in status.conditions}.get("WorkerHung")

    plan = plan_reconcile(spec, st, pods, generation=1, now=T0 + 5)
    cond = hung_condition(plan.status)
    assert (cond.status, cond.reason) == ("True", "WorkerHung")
    assert "rank 1 (pod j-worker-1) made no progress at step 120" in cond.message
    plan.status.step = 100  # resumed from the checkpoint before the hang: still short of it
    plan = plan_reconcile(spec, plan.status, pods, generation=1, now=T0 + 20)
    assert hung_condition(plan.status).status == "True"
    plan.status.step = 121
    plan = plan_reconcile(spec, plan.status, pods, generation=1, now=T0 + 40)
    cond = hung_condition(plan.status)
    assert (cond.status, cond.reason) == ("False", "Recovered") and "hung at step 120" in cond.message
    assert cond.last_transition_time == rfc3339(T0 + 40)
    quiet = plan_reconcile(spec, running(), pods, generation=1, now=T0)
    assert hung_condition(quiet.status) is None  # a job that never hung does not show it


def test_replace_rescale_rebalance_and_keep() -> None:
    spec, st = _spec(policy={"allowedActions": ["rescale", "replaceWorker"]}), running()
    out = apply_decision(st, spec, ReplaceWorker(rank=1, reason="slow node", exclude_node="n1"), (_sample(1),))
    assert [e.node for e in controller(st).excluded_nodes] == ["n1"]
    assert out.delete_pod is None and st.decisions[-1].rank == 1
    out = apply_decision(st, spec, ReplaceWorker(rank=0, reason="slow pod"), (_sample(0),))
    assert out.delete_pod == "j-worker-0" and out.events[-1].message == "replacing rank 0 (pod j-worker-0): slow pod"
    out = apply_decision(st, spec, Rescale(replicas=99, reason="more"))
    assert out.scale_to == 4 and st.decisions[-1].replicas == 4  # clamped to maxReplicas
    out = apply_decision(st, spec, Rebalance(batch_sizes={0: 40, 1: 24}, reason="even out"))
    assert controller(st).command is not None and controller(st).command["batchSizes"] == {"0": 40, "1": 24}
    assert out.events[-1].message == "per-rank batch sizes rank0=40 rank1=24: even out"
    before = st.model_copy(deep=True)
    assert apply_decision(st, spec, Keep("fine")).applied is None and st == before
    fixed = running()
    with pytest.raises(Refused, match=r"spec\.mode fixes sync"):
        apply_decision(fixed, _spec(mode="sync"), SwitchMode(mode="async", reason="x"))
    assert not fixed.decisions and controller(fixed).command is None


def test_only_pod_events_that_change_what_a_pass_reads_wake_the_job() -> None:
    seen: dict[str, PodView] = {}
    created = {"metadata": {"name": "j-worker-0", "uid": "u0", "labels": {"sgdjob.dev/replica-index": "0"}}}
    assert pod_changed(seen, "ADDED", created)
    unschedulable = {
        **created,
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]},
    }
    assert not pod_changed(seen, "MODIFIED", unschedulable)  # the scheduler's note: nothing a pass acts on
    bound = {**created, "spec": {"nodeName": "node-1"}, "status": {"phase": "Pending"}}
    assert pod_changed(seen, "MODIFIED", bound) and not pod_changed(seen, "MODIFIED", bound)
    ready = {**bound, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_changed(seen, "MODIFIED", ready)
    assert pod_changed(seen, "DELETED", ready) and seen == {}


def test_kubectl_get_shows_rounded_figures_and_a_rebalanced_sync() -> None:
    st = running()
    rank0 = WorkerStatus(rank=0, step=10, validation_loss=0.31834566593170166, validation_accuracy=0.9123456)
    batches = [dataclasses.replace(_sample(r), batch_size=b, loss=2.718281828) for r, b in enumerate((40, 40, 16))]
    record_observation(st, Observation(T0, tuple(batches), {}, control_status=rank0), None)
    assert (st.loss, st.validation_loss, st.validation_accuracy) == (2.718, 0.3183, 0.9123)
    assert (st.mode, st.mode_summary, st.batches) == ("sync", "sync (rebalanced)", "40/40/16")
    record_observation(st, Observation(T0, (_sample(0), _sample(1)), {}), None)  # back to equal batches
    assert (st.mode, st.mode_summary, st.batches) == ("sync", "sync", None)
    many = tuple(dataclasses.replace(_sample(r), batch_size=24 if r == 7 else 32) for r in range(20))
    record_observation(st, Observation(T0, many, {}), None)
    assert st.batches == "24..32 over 20 ranks"


def test_status_eta_counts_to_the_target_from_the_validation_trend_then_to_the_last_step() -> None:
    spec = _spec(training={"steps": 1000, "dataset": "digits", "target": {"metric": "accuracy", "value": 0.9}})
    st = running()
    for i, acc in enumerate((0.5, 0.6, 0.7)):  # 10 steps a second, +0.1 accuracy every 100 steps
        rank0 = WorkerStatus(rank=0, step=100 * (i + 1), validation_accuracy=acc, validation_step=100 * (i + 1))
        obs = Observation(T0 + 10 * i, (_sample(0),), {}, job_step=100 * (i + 1), control_status=rank0)
        record_observation(st, obs, None, spec)
    # 0.9 at step 500, 200 steps from step 300 at 10 steps/s
    assert (st.eta, st.eta_seconds, st.eta_basis) == ("20s", 20.0, "target")
    no_target = running()
    for i in range(3):
        obs = Observation(T0 + 10 * i, (_sample(0),), {}, job_step=100 * (i + 1))
        record_observation(no_target, obs, None, _spec(training={"steps": 1000}))
    assert (no_target.eta, no_target.eta_basis) == ("1m10s", "last step")
    assert load_status(dump_status(st)).eta == "20s"  # the points survive in status (an operator restart)
