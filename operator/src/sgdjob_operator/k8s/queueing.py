"""The I/O half of gang scheduling and Kueue, one step of a reconciliation pass each: make the
job's PodGroup match the spec, and find whether Kueue lets the job run. Level-based: both read the
objects from the API every pass and compare them with what the pure builders want.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.k8s import gang
from sgdjob_operator.k8s.builders import JobRef, build_pod_group, build_workload
from sgdjob_operator.k8s.client import ApiError, Kube
from sgdjob_operator.k8s.status import Event

QUEUED_POLL_S = 5.0  # how soon a queued job looks at its Workload again (no watch on Kueue's objects)


@dataclass(slots=True)
class Gate:
    """What a pass learned: `ready` False holds worker creation (no PodGroup yet), `queued` says why
    Kueue keeps the job from running ('' when it may run), `problem` is a repeated failure (one Event
    per distinct text), `events` are changes made."""

    ready: bool = True
    queued: str = ""
    problem: str = ""
    events: list[Event] = field(default_factory=list)


def _owned(obj: dict[str, Any], ref: JobRef) -> bool:
    return any(o.get("uid") == ref.uid for o in obj["metadata"].get("ownerReferences") or [])


async def ensure_pod_group(kube: Kube, ref: JobRef, spec: SGDJobSpec, gate: Gate) -> None:
    """Create the PodGroup before any worker pod, and keep minMember (and queue, priority, timeout)
    at what the spec and the replicas in force say."""
    policy = gang.gang_of(spec)
    desired = build_pod_group(ref, spec)
    if policy is None or desired is None:
        return
    path = gang.pod_group_path(policy.gang, ref.namespace, ref.pod_group)
    kind = f"{policy.gang.value} PodGroup {ref.pod_group}"
    try:
        actual = await kube.get(path)
        if actual is None:
            if await kube.create_at(gang.pod_group_path(policy.gang, ref.namespace), desired):
                gate.events.append(
                    Event("Normal", "PodGroupCreated", f"{kind} created (minMember {desired['spec']['minMember']})")
                )
            return
        if not _owned(actual, ref):
            gate.ready = False
            gate.problem = f"{kind} exists but is not this job's: delete it or rename the job"
            return
        patch = gang.pod_group_patch(actual, desired)
        if patch is not None:
            await kube.patch(path, patch)
            before = {k: (actual.get("spec") or {}).get(k) for k in patch["spec"]}
            gate.events.append(Event("Normal", "PodGroupUpdated", f"{kind}: {before} -> {patch['spec']}"))
    except ApiError as err:
        gate.ready = False
        hint = (
            " (is its CRD installed, and does the operator's RBAC allow podgroups?)" if err.status in (403, 404) else ""
        )
        gate.problem = f"cannot reconcile {kind}{hint}: {err}"


async def _priority(kube: Kube, name: str | None) -> tuple[str, int] | None:
    """The worker pods' PriorityClass and its value, which a Kueue Workload carries side by side."""
    if not name:
        return None
    obj = await kube.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
    return (str(name), int(obj.get("value", 0))) if obj else None


async def kueue_gate(
    kube: Kube, ref: JobRef, spec: SGDJobSpec, labels: dict[str, str], *, finished: bool, image: str, gate: Gate
) -> None:
    """A job labelled `kueue.x-k8s.io/queue-name` runs only while its Workload is admitted. The
    Workload is created for it, re-created when the replicas change (Kueue re-queues a job whose pod
    sets changed), and deleted when the job finishes, which gives its quota back."""
    queue = gang.queue_name(labels)
    if queue is None:
        return
    path = gang.workload_path(ref.namespace, ref.workload)
    try:
        actual = await kube.get(path)
        if actual is not None and not _owned(actual, ref):
            gate.queued = f"Workload {ref.workload} exists but is not this job's"
            gate.problem = f"{gate.queued}: delete it or rename the job"
            return
        if finished:
            if actual is not None and await kube.delete_at(path):
                gate.events.append(
                    Event(
                        "Normal",
                        "WorkloadDeleted",
                        f"job finished: Kueue Workload {ref.workload} deleted, quota released",
                    )
                )
            return
        count = gang.workload_count(actual) if actual is not None else None
        if actual is not None and count != spec.replicas:
            await kube.delete_at(path)
            gate.queued = f"replicas changed from {count} to {spec.replicas}: re-queued in LocalQueue {queue}"
            gate.events.append(Event("Normal", "WorkloadRequeued", f"Kueue Workload {ref.workload}: {gate.queued}"))
            return
        if actual is None:
            body = build_workload(ref, spec, queue, default_image=image)
            priority = await _priority(kube, gang.pod_set_priority_class(body))
            if priority is not None:
                body = build_workload(ref, spec, queue, default_image=image, priority=priority)
            if await kube.create_at(gang.workload_path(ref.namespace), body):
                gate.events.append(
                    Event(
                        "Normal",
                        "WorkloadCreated",
                        f"Kueue Workload {ref.workload} for {spec.replicas} workers in LocalQueue {queue}",
                    )
                )
            gate.queued = f"waiting for Kueue admission in LocalQueue {queue}"
            return
        admitted, why = gang.admission(actual)
        gate.queued = "" if admitted else why
    except ApiError as err:
        gate.queued = f"cannot reach the Kueue Workload {ref.workload}"
        hint = (
            " (is Kueue installed, and does the operator's RBAC allow workloads?)" if err.status in (403, 404) else ""
        )
        gate.problem = f"{gate.queued}{hint}: {err}"
