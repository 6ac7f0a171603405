"""Gang scheduling and Kueue, pure parts: the spec's rules, the PodGroups and Workload the operator
writes, the worker pods' scheduling fields, reading Kueue's admission, and the plan of a queued job."""

from __future__ import annotations

from typing import Any

import pytest

from sgdjob_operator.api.models import Phase, SGDJobStatus
from sgdjob_operator.api.validation import SpecError, validate_spec
from sgdjob_operator.k8s import gang
from sgdjob_operator.k8s.builders import JobRef, build_pod_group, build_rdzv_pod, build_worker_pod, build_workload
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import PodView, rfc3339

JOB = JobRef(name="j", namespace="ns", uid="u-1")
SCRAPE = {"prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"}  # every worker pod has these
IMAGE = "registry/trainer:1"
T0 = 1_800_000_000.0
GPU_TEMPLATE = {"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 8}}}]}}


def _spec(scheduling: dict[str, Any] | None = None, **extra: Any) -> Any:
    run_policy = {"schedulingPolicy": scheduling} if scheduling is not None else {}
    return validate_spec({"replicas": 4, "minReplicas": 2, "maxReplicas": 6, "runPolicy": run_policy, **extra})


def _problems(scheduling: dict[str, Any], **extra: Any) -> list[str]:
    with pytest.raises(SpecError) as err:
        _spec(scheduling, **extra)
    return err.value.problems


@pytest.mark.parametrize(
    ("scheduling", "extra", "field", "words"),
    [
        ({"queue": "q"}, {}, "schedulingPolicy.queue", "set gang to volcano or coscheduling"),
        ({"gang": "coscheduling", "queue": "q"}, {}, "schedulingPolicy.queue", "Volcano queue"),
        ({"gang": "volcano", "scheduleTimeoutSeconds": 30}, {}, "scheduleTimeoutSeconds", "set gang to coscheduling"),
        ({"gang": "volcano", "minAvailable": 7}, {}, "minAvailable", "must be <= maxReplicas (6)"),
        ({"gang": "slurm"}, {}, "schedulingPolicy.gang", "'none', 'volcano' or 'coscheduling'"),
        (
            {"gang": "volcano", "priorityClass": "high"},
            {"template": {"spec": {"priorityClassName": "low"}}},
            "schedulingPolicy.priorityClass",
            "remove template.spec.priorityClassName",
        ),
        (
            {"gang": "coscheduling"},
            {"template": {"spec": {"schedulerName": "default-scheduler"}}},
            "schedulingPolicy.schedulerName",
            "'scheduler-plugins-scheduler' but template.spec.schedulerName",
        ),
    ],
)
def test_bad_scheduling_policies_name_the_field_and_the_fix(
    scheduling: dict[str, Any], extra: dict[str, Any], field: str, words: str
) -> None:
    problems = _problems(scheduling, **extra)
    assert len(problems) == 1 and problems[0].startswith("spec.runPolicy.") and field in problems[0], problems
    assert words in problems[0], problems


def test_no_gang_leaves_pods_alone_and_builds_no_group() -> None:
    for spec in (_spec(), _spec({"gang": "none"})):
        pod = build_worker_pod(JOB, spec, 0, default_image=IMAGE)
        assert "schedulerName" not in pod["spec"] and set(pod["metadata"]["annotations"]) == SCRAPE
        assert build_pod_group(JOB, spec) is None


def test_volcano_group_and_pods() -> None:
    spec = _spec(
        {"gang": "volcano", "queue": "research", "priorityClass": "high"},
        template={"metadata": {"annotations": {"team": "vision"}}},
    )
    group = build_pod_group(JOB, spec)
    assert group is not None
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["kind"] == "PodGroup"
    assert group["spec"] == {"minMember": 2, "queue": "research", "priorityClassName": "high"}
    assert group["metadata"]["name"] == "j" and group["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    pod = build_worker_pod(JOB, spec, 3, default_image=IMAGE)
    assert pod["metadata"]["annotations"].keys() - SCRAPE == {"team", "scheduling.k8s.io/group-name"}
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "j"
    assert pod["spec"]["schedulerName"] == "volcano" and pod["spec"]["priorityClassName"] == "high"
    assert gang.COSCHEDULING_GROUP_LABEL not in pod["metadata"]["labels"]
    # The rendezvous store is not one of the gang's members: minMember counts worker pods only.
    rdzv = build_rdzv_pod(JOB, spec, default_image=IMAGE)
    assert "schedulerName" not in rdzv["spec"] and "annotations" not in rdzv["metadata"]


def test_coscheduling_group_and_pods() -> None:
    spec = _spec({"gang": "coscheduling", "scheduleTimeoutSeconds": 120, "schedulerName": "gang-sched"})
    group = build_pod_group(JOB, spec)
    assert group is not None and group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 120}
    pod = build_worker_pod(JOB, spec, 0, default_image=IMAGE)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "j"
    assert pod["spec"]["schedulerName"] == "gang-sched" and "priorityClassName" not in pod["spec"]
    default = build_worker_pod(JOB, _spec({"gang": "coscheduling"}), 0, default_image=IMAGE)
    assert default["spec"]["schedulerName"] == "scheduler-plugins-scheduler"


def test_min_member_counts_pods_and_follows_the_replicas_in_force() -> None:
    base = {"gang": "volcano", "minAvailable": 4}
    assert gang.pod_group_spec(_spec(base, nprocPerNode=8))["minMember"] == 4  # pods, not processes
    assert gang.pod_group_spec(_spec(base, replicas=3))["minMember"] == 3  # scaled below minAvailable
    assert gang.pod_group_spec(_spec(base, replicas=6))["minMember"] == 4
    assert gang.pod_group_spec(_spec({"gang": "volcano"}, replicas=6))["minMember"] == 2  # minReplicas


def test_pod_group_patch_only_when_it_drifted() -> None:
    desired = build_pod_group(JOB, _spec({"gang": "volcano", "minAvailable": 3}))
    assert desired is not None
    stored = {**desired, "spec": {**desired["spec"], "minResources": {"cpu": "4"}}}  # fields we do not own stay
    assert gang.pod_group_patch(stored, desired) is None
    smaller = build_pod_group(JOB, _spec({"gang": "volcano", "minAvailable": 3}, replicas=2))
    assert smaller is not None
    assert gang.pod_group_patch(stored, smaller) == {"spec": {"minMember": 2}}


def test_workload_asks_for_the_worker_pods_as_they_will_run() -> None:
    spec = _spec({"gang": "volcano", "priorityClass": "high"}, template=GPU_TEMPLATE)
    wl = build_workload(JOB, spec, "team-q", default_image=IMAGE, priority=("high", 1000))
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == "sgdjob-j" and wl["metadata"]["ownerReferences"][0]["kind"] == "SGDJob"
    assert wl["spec"]["queueName"] == "team-q"
    assert wl["spec"]["priorityClassRef"] == {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "high"}
    assert wl["spec"]["priority"] == 1000  # Kueue's rule: a priorityClassRef comes with its value
    (pod_set,) = wl["spec"]["podSets"]
    assert pod_set["name"] == "workers" and pod_set["count"] == 4
    container = pod_set["template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}} and container["image"] == IMAGE
    assert pod_set["template"]["spec"]["schedulerName"] == "volcano"
    assert "hostname" not in pod_set["template"]["spec"]
    assert gang.workload_count(wl) == 4 and gang.pod_set_priority_class(wl) == "high"
    plain = build_workload(JOB, _spec(), "team-q", default_image=IMAGE)
    assert "priority" not in plain["spec"] and "priorityClassRef" not in plain["spec"]


def _cond(kind: str, status: str, message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": kind, "message": message}


def test_admission_is_read_as_kueue_sets_it() -> None:
    wl = build_workload(JOB, _spec(), "team-q", default_image=IMAGE)
    assert gang.admission(wl) == (False, "waiting for Kueue admission in LocalQueue team-q")
    pending = {**wl, "status": {"conditions": [_cond("QuotaReserved", "False", "couldn't assign flavors")]}}
    assert gang.admission(pending)[1].endswith(": couldn't assign flavors")
    reserved = {
        **wl,
        "status": {"admission": {"clusterQueue": "cq"}, "conditions": [_cond("QuotaReserved", "True")]},
    }
    assert gang.admission(reserved)[0] is False  # quota alone: admission checks still pending
    admitted = {**reserved, "status": {**reserved["status"], "conditions": [_cond("Admitted", "True")]}}
    assert gang.admission(admitted) == (True, "") and gang.cluster_queue(admitted) == "cq"
    evicted = {
        **admitted,
        "status": {**admitted["status"], "conditions": [_cond("Admitted", "True"), _cond("Evicted", "True", "x")]},
    }
    admitted_now, why = gang.admission(evicted)
    assert not admitted_now and why.startswith("evicted by Kueue")
    assert gang.queue_name({"kueue.x-k8s.io/queue-name": "team-q"}) == "team-q" and gang.queue_name({}) is None


def _pod(index: int) -> PodView:
    return PodView(f"j-worker-{index}", f"u{index}", "worker", index, "Running", True, "10.0.0.1", None, False)


def test_a_queued_job_has_no_pods_until_admitted_and_an_eviction_takes_them_back() -> None:
    spec = _spec()
    why = "waiting for Kueue admission in LocalQueue team-q"
    plan = plan_reconcile(spec, SGDJobStatus(), [], generation=1, now=T0, queued=why)
    assert plan.create_workers == [] and not plan.create_rdzv and plan.status.phase is Phase.SUSPENDED
    suspended = {c.type: c for c in plan.status.conditions}["Suspended"]
    assert suspended.status == "True" and suspended.reason == "Queued" and why in suspended.message
    assert [e.reason for e in plan.events] == ["Queued"]
    again = plan_reconcile(spec, plan.status, [], generation=1, now=T0 + 5, queued=why)
    assert again.events == []  # one Event per change, not one per pass
    admitted = plan_reconcile(spec, again.status, [], generation=1, now=T0 + 10)
    assert admitted.create_workers == [0, 1, 2, 3] and admitted.create_rdzv
    assert "Admitted" in [e.reason for e in admitted.events] and "Resumed" not in [e.reason for e in admitted.events]
    running = admitted.status.model_copy(update={"phase": Phase.RUNNING, "start_time": rfc3339(T0 + 20)})
    evicted = plan_reconcile(spec, running, [_pod(i) for i in range(4)], generation=1, now=T0 + 30, queued="evicted")
    assert sorted(n for n, _ in evicted.delete_pods) == [f"j-worker-{i}" for i in range(4)]
    assert evicted.status.phase is Phase.SUSPENDED and [e.reason for e in evicted.events] == ["Queued"]
    # The user's own suspend wins over the queue and says so.
    user = plan_reconcile(_spec(runPolicy={"suspend": True}), evicted.status, [], generation=2, now=T0 + 40, queued="q")
    assert {c.type: c for c in user.status.conditions}["Suspended"].reason == "JobSuspended"
    assert [e.reason for e in user.events] == ["Suspended"]
