"""Pure builders and readers for gang scheduling (Volcano and scheduler-plugins coscheduling PodGroups)
and for Kueue (a Workload the job waits on). No I/O; `reconcile` and `queueing` carry them out.

The contracts are the published ones: Volcano finds a pod's group in the `scheduling.k8s.io/group-name`
annotation (volcano.sh/apis scheduling/v1beta1 labels.go, as Kubeflow's operators set it), coscheduling
in the `scheduling.x-k8s.io/pod-group` label (scheduler-plugins apis/scheduling/v1alpha1). Kueue admits
any Workload in a LocalQueue; the job's own controller (here the operator) holds the pods until the
Workload's `Admitted` condition is True, as Kueue's jobframework does for the kinds it knows.
"""

from __future__ import annotations

import copy
from typing import Any

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.api.scheduling import Gang, SchedulingPolicy

VOLCANO = ("scheduling.volcano.sh", "v1beta1")
COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1")
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE = ("kueue.x-k8s.io", "v1beta2")
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WORKER_POD_SET = "workers"
# Fields of a worker pod that say nothing about what it asks of the scheduler: left out of the Workload.
_PER_POD_FIELDS = ("hostname", "subdomain")


def pod_group_api(gang: Gang) -> tuple[str, str]:
    return VOLCANO if gang is Gang.VOLCANO else COSCHEDULING


def pod_group_path(gang: Gang, namespace: str, name: str | None = None) -> str:
    group, version = pod_group_api(gang)
    base = f"/apis/{group}/{version}/namespaces/{namespace}/podgroups"
    return f"{base}/{name}" if name else base


def workload_path(namespace: str, name: str | None = None) -> str:
    group, version = KUEUE
    base = f"/apis/{group}/{version}/namespaces/{namespace}/workloads"
    return f"{base}/{name}" if name else base


def gang_of(spec: SGDJobSpec) -> SchedulingPolicy | None:
    policy = spec.run_policy.scheduling_policy
    return policy if policy is not None and policy.gang is not Gang.NONE else None


def pod_scheduling(spec: SGDJobSpec, group: str) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(labels, annotations, pod spec fields) that put a worker pod into the job's gang."""
    policy = gang_of(spec)
    if policy is None:
        return {}, {}, {}
    fields = {"schedulerName": policy.scheduler or ""}
    if policy.priority_class:
        fields["priorityClassName"] = policy.priority_class
    if policy.gang is Gang.VOLCANO:
        return {}, {VOLCANO_GROUP_ANNOTATION: group}, fields
    return {COSCHEDULING_GROUP_LABEL: group}, {}, fields


def pod_group_spec(spec: SGDJobSpec) -> dict[str, Any]:
    """The PodGroup's spec as the operator wants it now; minMember follows the replicas in force."""
    policy = gang_of(spec)
    if policy is None:
        return {}
    out: dict[str, Any] = {"minMember": policy.min_member(spec.min_workers, spec.replicas)}
    if policy.gang is Gang.VOLCANO:
        out["queue"] = policy.queue or "default"  # Volcano's own default, written out so drift is visible
        if policy.priority_class:
            out["priorityClassName"] = policy.priority_class
    elif policy.schedule_timeout_seconds is not None:
        out["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds
    return out


def pod_group(meta: dict[str, Any], spec: SGDJobSpec) -> dict[str, Any] | None:
    policy = gang_of(spec)
    if policy is None:
        return None
    group, version = pod_group_api(policy.gang)
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": meta, "spec": pod_group_spec(spec)}


def pod_group_patch(actual: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch bringing the stored PodGroup's spec to the desired one; None when they agree."""
    have = actual.get("spec") or {}
    want = desired.get("spec") or {}
    changed = {k: v for k, v in want.items() if have.get(k) != v}
    return {"spec": changed} if changed else None


def queue_name(labels: dict[str, str] | None) -> str | None:
    """The Kueue LocalQueue a job is submitted to, from its `kueue.x-k8s.io/queue-name` label."""
    value = (labels or {}).get(KUEUE_QUEUE_LABEL)
    return value or None


def workload(
    meta: dict[str, Any], queue: str, worker_pod: dict[str, Any], count: int, priority: tuple[str, int] | None
) -> dict[str, Any]:
    """A Kueue Workload asking for `count` worker pods like `worker_pod` (its resources, node selector,
    tolerations and affinity are what Kueue fits to the ClusterQueue's flavors)."""
    pod_spec = {k: v for k, v in copy.deepcopy(worker_pod["spec"]).items() if k not in _PER_POD_FIELDS}
    labels = {k: v for k, v in (worker_pod["metadata"].get("labels") or {}).items()}
    body: dict[str, Any] = {
        "queueName": queue,
        "podSets": [
            {"name": WORKER_POD_SET, "count": count, "template": {"metadata": {"labels": labels}, "spec": pod_spec}}
        ],
    }
    if priority is not None:
        name, value = priority
        body["priorityClassRef"] = {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": name}
        body["priority"] = value
    return {"apiVersion": "/".join(KUEUE), "kind": "Workload", "metadata": meta, "spec": body}


def workload_count(obj: dict[str, Any]) -> int | None:
    for pod_set in (obj.get("spec") or {}).get("podSets") or []:
        if pod_set.get("name") == WORKER_POD_SET:
            return int(pod_set.get("count", 1))
    return None


def pod_set_priority_class(obj: dict[str, Any]) -> str | None:
    for pod_set in (obj.get("spec") or {}).get("podSets") or []:
        name = ((pod_set.get("template") or {}).get("spec") or {}).get("priorityClassName")
        if name:
            return str(name)
    return None


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def admission(obj: dict[str, Any]) -> tuple[bool, str]:
    """(admitted?, why not): admitted once Kueue has reserved quota and every admission check passed
    (condition Admitted True, with status.admission naming the ClusterQueue); an eviction takes it back."""
    evicted = _condition(obj, "Evicted")
    if evicted is not None and evicted.get("status") == "True":
        return False, f"evicted by Kueue ({evicted.get('reason', '')}): {evicted.get('message', '')}".strip()
    admitted = _condition(obj, "Admitted")
    if admitted is not None and admitted.get("status") == "True" and (obj.get("status") or {}).get("admission"):
        return True, ""
    pending = _condition(obj, "QuotaReserved") or admitted
    detail = f": {pending['message']}" if pending and pending.get("message") else ""
    return False, f"waiting for Kueue admission in LocalQueue {(obj.get('spec') or {}).get('queueName')}{detail}"


def cluster_queue(obj: dict[str, Any]) -> str:
    return str(((obj.get("status") or {}).get("admission") or {}).get("clusterQueue") or "")
