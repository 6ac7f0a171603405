"""Gang scheduling and Kueue against a real kube-apiserver with the projects' published CRDs installed
(tests/fixtures/crds). Their schedulers and Kueue's controllers are not run: the tests check the
objects the operator writes, and play Kueue's part by patching a Workload's status as Kueue does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.controlplane import ControlPlane
from tests.operator.conftest import GROUP, PLURAL, VERSION, Cluster, Operator, wait_for

pytestmark = pytest.mark.k8s

CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "crds"
VOLCANO = ("scheduling.volcano.sh", "v1beta1", "podgroups")
COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
KUEUE = ("kueue.x-k8s.io", "v1beta2", "workloads")
PRIORITY = "sgdjob-test-high"


@pytest.fixture(scope="module")
def third_party(k8s_crd: ControlPlane) -> ControlPlane:
    for path in sorted(CRDS.glob("*.yaml")):
        # v1.20's kubectl does not know newer schema fields (CEL rules, selectableFields); the server drops them.
        result = k8s_crd.kubectl("create", "--validate=false", "-f", str(path), check=False)
        assert result.returncode == 0 or "AlreadyExists" in result.stderr, result.stderr
    for name in ("podgroups.scheduling.volcano.sh", "podgroups.scheduling.x-k8s.io", "workloads.kueue.x-k8s.io"):
        k8s_crd.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
    priority = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": PRIORITY}}
    k8s_crd.kubectl("apply", "-f", "-", input_text=yaml.safe_dump({**priority, "value": 1000}))
    return k8s_crd


def _get(cluster: Cluster, api: tuple[str, str, str], name: str) -> dict[str, Any] | None:
    from kubernetes.client import ApiException

    try:
        obj: dict[str, Any] = cluster.custom.get_namespaced_custom_object(*api[:2], cluster.ns, api[2], name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return obj


def _apply(cluster: Cluster, name: str, spec: dict[str, Any], labels: dict[str, str] | None = None) -> None:
    meta = {"name": name, "namespace": cluster.ns, "labels": labels or {}}
    doc = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SGDJob", "metadata": meta, "spec": spec}
    cluster.plane.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))


def _min_member(cluster: Cluster, api: tuple[str, str, str], name: str, want: int) -> dict[str, Any]:
    return wait_for(
        f"{api[0]} PodGroup {name} minMember {want}",
        lambda: (pg := _get(cluster, api, name)) is not None and pg["spec"].get("minMember") == want and pg,
    )


def test_volcano_pod_group_comes_first_and_follows_rescales(
    third_party: ControlPlane, cluster: Cluster, operator: Operator
) -> None:
    # Someone else's PodGroup under the job's name: the gang's pods must not start without their own.
    foreign = {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": {"name": "vg"}}
    cluster.custom.create_namespaced_custom_object(*VOLCANO[:2], cluster.ns, VOLCANO[2], {**foreign, "spec": {}})
    scheduling = {"gang": "volcano", "queue": "research", "priorityClass": PRIORITY, "minAvailable": 3}
    passes = operator.passes()
    _apply(
        cluster,
        "vg",
        {"replicas": 3, "minReplicas": 1, "maxReplicas": 4, "runPolicy": {"schedulingPolicy": scheduling}},
    )
    wait_for("SchedulingFailed event", lambda: "SchedulingFailed" in cluster.reasons("vg"))
    # A pass posts its Events after its pod creations: the pass that refused has created nothing.
    assert cluster.pods("vg") == {}, "worker pods created without the job's PodGroup"
    # The Event is posted once, but the hold must last: the next pass (a held gang is re-polled)
    # still finds the foreign PodGroup and must still create nothing.
    wait_for("a second pass over the held job", lambda: operator.passes() >= passes + 2)
    assert cluster.pods("vg") == {}, "worker pods created on a later pass without the job's PodGroup"

    cluster.custom.delete_namespaced_custom_object(*VOLCANO[:2], cluster.ns, VOLCANO[2], "vg")
    group = _min_member(cluster, VOLCANO, "vg", 3)
    pods = wait_for("3 worker pods", lambda: (p := cluster.pods("vg")) and len(p) == 3 and p)
    uid = cluster.job("vg")["metadata"]["uid"]
    assert group["spec"]["queue"] == "research" and group["spec"]["priorityClassName"] == PRIORITY
    assert [(o["kind"], o["uid"]) for o in group["metadata"]["ownerReferences"]] == [("SGDJob", uid)]
    for pod in pods.values():
        assert pod.metadata.annotations["scheduling.k8s.io/group-name"] == "vg"
        assert pod.spec.scheduler_name == "volcano" and pod.spec.priority_class_name == PRIORITY
        assert pod.spec.priority == 1000  # the API server resolved the class: the pods can be admitted
    # The Event follows the PodGroup's creation; the pods can be listed before it is (CI race).
    wait_for("PodGroupCreated event", lambda: "PodGroupCreated" in cluster.reasons("vg"))

    cluster.plane.kubectl("scale", "sgdjob/vg", "-n", cluster.ns, "--replicas=2")
    _min_member(cluster, VOLCANO, "vg", 2)  # a group of 3 could never be complete with 2 pods
    wait_for("PodGroupUpdated event", lambda: "PodGroupUpdated" in cluster.reasons("vg"))
    cluster.plane.kubectl("scale", "sgdjob/vg", "-n", cluster.ns, "--replicas=4")
    _min_member(cluster, VOLCANO, "vg", 3)
    wait_for("4 worker pods", lambda: len(cluster.pods("vg")) == 4)


def test_coscheduling_pod_group_and_labelled_pods(
    third_party: ControlPlane, cluster: Cluster, operator: Operator
) -> None:
    scheduling = {"gang": "coscheduling", "scheduleTimeoutSeconds": 90}
    _apply(
        cluster,
        "cg",
        {"replicas": 2, "minReplicas": 2, "maxReplicas": 3, "runPolicy": {"schedulingPolicy": scheduling}},
    )
    group = _min_member(cluster, COSCHEDULING, "cg", 2)
    assert group["spec"]["scheduleTimeoutSeconds"] == 90
    pods = wait_for("2 worker pods", lambda: (p := cluster.pods("cg")) and len(p) == 2 and p)
    for pod in pods.values():
        assert pod.metadata.labels["scheduling.x-k8s.io/pod-group"] == "cg"
        assert pod.spec.scheduler_name == "scheduler-plugins-scheduler"
    rdzv = wait_for("rendezvous pod", lambda: cluster.pods("cg", role="rendezvous").get("cg-rdzv"))
    assert rdzv.spec.scheduler_name == "default-scheduler"  # not a gang member


def _condition(kind: str, status: str, reason: str, message: str = "") -> dict[str, str]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": now}


def _kueue_admits(cluster: Cluster, name: str, count: int) -> None:
    """What Kueue's scheduler writes when it admits a Workload (status subresource)."""
    admission = {
        "clusterQueue": "cluster-q",
        "podSetAssignments": [{"name": "workers", "count": count, "flavors": {"cpu": "default-flavor"}}],
    }
    conditions = [
        _condition("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-q"),
        _condition("Admitted", "True", "Admitted", "The workload is admitted"),
    ]
    body = {"status": {"admission": admission, "conditions": conditions}}
    cluster.custom.patch_namespaced_custom_object_status(*KUEUE[:2], cluster.ns, KUEUE[2], name, body)


def test_kueue_job_waits_for_admission(third_party: ControlPlane, cluster: Cluster, operator: Operator) -> None:
    template = {"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}]}}
    passes = operator.passes()
    _apply(cluster, "kq", {"replicas": 2, "template": template}, labels={"kueue.x-k8s.io/queue-name": "team-q"})
    status = wait_for("Suspended while queued", lambda: (s := cluster.status("kq")).get("phase") == "Suspended" and s)
    suspended = {c["type"]: c for c in status["conditions"]}["Suspended"]
    assert suspended["reason"] == "Queued" and "waiting for Kueue admission in LocalQueue team-q" in status["message"]
    wl = wait_for("Workload", lambda: _get(cluster, KUEUE, "sgdjob-kq"))
    assert wl["spec"]["queueName"] == "team-q"
    (pod_set,) = wl["spec"]["podSets"]
    assert pod_set["name"] == "workers" and pod_set["count"] == 2
    assert pod_set["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "1Gi"}
    uid = cluster.job("kq")["metadata"]["uid"]
    assert [o["uid"] for o in wl["metadata"]["ownerReferences"]] == [uid]
    # The first pass wrote Suspended after its (absent) pod creations; the second is the first to find
    # the Workload already there, still without Admitted: neither may start a pod.
    wait_for("a second pass over the queued job", lambda: operator.passes() >= passes + 2)
    assert cluster.pods("kq") == {} and cluster.pods("kq", role="rendezvous") == {}
    assert {"WorkloadCreated", "Queued"} <= set(cluster.reasons("kq"))

    _kueue_admits(cluster, "sgdjob-kq", 2)
    cluster.run_all("kq", 2, ip_base=21)
    wait_for("Running once admitted", lambda: cluster.status("kq").get("phase") == "Running")
    wait_for("the Admitted event", lambda: "Admitted" in cluster.reasons("kq"))

    # Kueue preempts the job: it evicts the Workload, and the job's controller must stop its pods.
    evicted = [
        _condition("Admitted", "True", "Admitted", "The workload is admitted"),
        _condition("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload"),
    ]
    cluster.custom.patch_namespaced_custom_object_status(
        *KUEUE[:2], cluster.ns, KUEUE[2], "sgdjob-kq", {"status": {"conditions": evicted}}
    )
    wait_for(
        "pods removed on eviction", lambda: all(p.metadata.deletion_timestamp for p in cluster.pods("kq").values())
    )
    status = wait_for("Suspended after eviction", lambda: (s := cluster.status("kq")).get("phase") == "Suspended" and s)
    assert "Preempted" in status["message"]

    _kueue_admits(cluster, "sgdjob-kq", 2)  # re-admitted: Kueue clears Evicted when it admits again
    wait_for(
        "pods back", lambda: len([p for p in cluster.pods("kq").values() if not p.metadata.deletion_timestamp]) == 2
    )
    cluster.run_all("kq", 2, ip_base=22)
    for i in range(2):
        cluster.end_pod(f"kq-worker-{i}", 0)
    wait_for("Succeeded", lambda: cluster.status("kq").get("phase") == "Succeeded")
    wait_for("Workload deleted when the job finished", lambda: _get(cluster, KUEUE, "sgdjob-kq") is None)
    job = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "kq")
    assert job["status"]["phase"] == "Succeeded"
