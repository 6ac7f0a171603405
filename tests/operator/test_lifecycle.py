"""The operator against a real kube-apiserver: objects, status, scale, failures, suspend, restart, delete."""

from __future__ import annotations

import base64
import json
import urllib.request
from typing import Any

import pytest

from tests.operator.conftest import TRAINER_IMAGE, Cluster, Operator, wait_for

pytestmark = pytest.mark.k8s

TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "vision"}},
    "spec": {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "containers": [
            {
                "name": "trainer",
                "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "1Gi"}},
                "env": [{"name": "EXTRA", "value": "kept"}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            },
            {"name": "sidecar", "image": "busybox", "command": ["sleep", "infinity"]},
        ],
    },
}


def _phase(cluster: Cluster, name: str, phase: str) -> Any:
    return wait_for(f"{name} phase {phase}", lambda: (s := cluster.status(name)).get("phase") == phase and s)


def test_objects_are_built_as_specified(cluster: Cluster, operator: Operator) -> None:
    cluster.apply("objs", {"replicas": 2, "minReplicas": 1, "maxReplicas": 4, "nprocPerNode": 2, "template": TEMPLATE})
    pods = wait_for("2 worker pods", lambda: (p := cluster.pods("objs")) and len(p) == 2 and p)
    job = cluster.job("objs")
    uid = job["metadata"]["uid"]
    pod = pods["objs-worker-1"]
    env = {e.name: e for e in pod.spec.containers[0].env}
    assert env["PET_NNODES"].value == "1:4" and env["PET_NPROC_PER_NODE"].value == "2"
    assert env["PET_RDZV_BACKEND"].value == "c10d" and env["PET_RDZV_ID"].value == uid
    assert env["PET_RDZV_ENDPOINT"].value == f"objs-rdzv.objs.{cluster.ns}.svc:29400"
    assert int(env["PET_MAX_RESTARTS"].value) >= 3
    assert env["NODE_NAME"].value_from.field_ref.field_path == "spec.nodeName"
    assert env["EXTRA"].value == "kept"
    assert (
        pod.metadata.labels["sgdjob.dev/job-name"] == "objs" and pod.metadata.labels["sgdjob.dev/replica-index"] == "1"
    )
    assert pod.metadata.labels["team"] == "vision"
    assert pod.spec.hostname == "objs-worker-1" and pod.spec.subdomain == "objs"
    assert pod.spec.node_selector == {"pool": "gpu"} and pod.spec.tolerations[0].key == "nvidia.com/gpu"
    assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
    assert pod.spec.containers[0].image == TRAINER_IMAGE  # the template named none: the operator's setting
    assert [c.name for c in pod.spec.containers] == ["trainer", "sidecar"] and pod.spec.containers[1].image == "busybox"
    assert {v.name for v in pod.spec.volumes} >= {"data", "sgdjob-config", "sgdjob-control"}
    assert pod.spec.restart_policy == "Never"
    assert [p.container_port for p in pod.spec.containers[0].ports] == [9400, 9401]
    rdzv = wait_for("rendezvous pod", lambda: cluster.pods("objs", role="rendezvous").get("objs-rdzv"))
    assert rdzv.spec.hostname == "objs-rdzv" and rdzv.spec.node_selector == {"pool": "gpu"}

    svc = cluster.core.read_namespaced_service("objs", cluster.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    secret = cluster.core.read_namespaced_secret("objs-control", cluster.ns)
    assert len(base64.b64decode(secret.data["token"])) >= 32
    run_config = json.loads(cluster.core.read_namespaced_config_map("objs-config", cluster.ns).data["run-config.json"])
    assert run_config["jobName"] == "objs" and run_config["mode"] == "sync" and run_config["referenceWorldSize"] == 2
    for obj in (pod, rdzv, svc, secret):
        assert [(o.kind, o.uid, o.controller) for o in obj.metadata.owner_references] == [("SGDJob", uid, True)]

    status = wait_for("status counts the pods", lambda: (s := cluster.status("objs")).get("replicas") == 2 and s)
    assert status["phase"] == "Pending" and status["ready"] == "0/2" and status["targetMode"] == "sync"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Created": "True", "Running": "False"}
    assert status["observedGeneration"] == job["metadata"]["generation"]


def test_a_deleted_or_edited_child_object_is_restored_on_resync(cluster: Cluster, operator: Operator) -> None:
    """The operator re-asserts a job's Service, Secret and ConfigMap every resync (3 s here), reading
    them from the API server's cache: what someone deleted comes back, a hand edit is undone."""
    cluster.apply("kept", {"replicas": 1})
    wait_for("the run config", lambda: cluster.core.read_namespaced_config_map("kept-config", cluster.ns))
    original = cluster.core.read_namespaced_config_map("kept-config", cluster.ns).data
    cluster.core.delete_namespaced_service("kept", cluster.ns, _preload_content=False)
    cluster.core.delete_namespaced_secret("kept-control", cluster.ns, _preload_content=False)
    cluster.core.patch_namespaced_config_map("kept-config", cluster.ns, {"data": {"run-config.json": "{}"}})
    wait_for("the Service back", lambda: cluster.core.read_namespaced_service("kept", cluster.ns), timeout=20)
    secret = wait_for("the Secret back", lambda: cluster.core.read_namespaced_secret("kept-control", cluster.ns))
    assert len(base64.b64decode(secret.data["token"])) >= 32
    wait_for(
        "the run config restored",
        lambda: cluster.core.read_namespaced_config_map("kept-config", cluster.ns).data == original,
        timeout=20,
    )


def test_status_columns_scale_and_success(cluster: Cluster, operator: Operator) -> None:
    cluster.apply("life", {"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "runPolicy": {"cleanPodPolicy": "All"}})
    cluster.run_all("life", 2)
    status = _phase(cluster, "life", "Running")
    assert status["ready"] == "2/2" and status["readyReplicas"] == 2 and status["startTime"]
    row = cluster.plane.kubectl("get", "sgdjob", "life", "-n", cluster.ns, "--no-headers").stdout.split()
    assert row[:4] == ["life", "Running", "2/2", "0"]  # mode is empty until workers report it

    cluster.plane.kubectl("scale", "sgdjob/life", "-n", cluster.ns, "--replicas=3")
    wait_for("worker 2 created", lambda: "life-worker-2" in cluster.pods("life"))
    assert _phase(cluster, "life", "Adapting")["ready"] == "2/3"
    cluster.run_pod("life-worker-2", "127.0.10.4", node="node-2")
    _phase(cluster, "life", "Running")
    cluster.plane.kubectl("scale", "sgdjob/life", "-n", cluster.ns, "--replicas=1")
    wait_for("scaled down to 1", lambda: set(cluster.pods("life")) == {"life-worker-0"})
    assert _phase(cluster, "life", "Running")["ready"] == "1/1"

    cluster.end_pod("life-worker-0", 0)
    status = _phase(cluster, "life", "Succeeded")
    assert status["completionTime"] and {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"
    # The Event is posted beside the status write, not before it: wait for it as a user's `describe` would.
    wait_for("the WorkersSucceeded event", lambda: "WorkersSucceeded" in cluster.reasons("life"))
    wait_for(
        "cleanPodPolicy All removes the pods",
        lambda: not cluster.pods("life") and not cluster.pods("life", role="rendezvous"),
    )


def test_failed_workers_restart_until_backoff_limit(cluster: Cluster, operator: Operator) -> None:
    cluster.apply("flaky", {"replicas": 2, "runPolicy": {"backoffLimit": 1}})
    pods = cluster.run_all("flaky", 2, ip_base=11)
    _phase(cluster, "flaky", "Running")
    first_uid = pods["flaky-worker-0"].metadata.uid
    cluster.end_pod("flaky-worker-0", 2)  # not 3: that is the agent's "rendezvous closed", not counted
    wait_for(
        "worker 0 recreated",
        lambda: (p := cluster.pods("flaky").get("flaky-worker-0")) is not None and p.metadata.uid != first_uid,
    )
    status = wait_for("restart counted", lambda: (s := cluster.status("flaky")).get("restarts") == 1 and s)
    assert status["phase"] in ("Adapting", "Running")
    wait_for("the WorkerFailed event", lambda: "WorkerFailed" in cluster.reasons("flaky"))
    cluster.end_pod("flaky-worker-1", 1)
    status = _phase(cluster, "flaky", "Failed")
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["reason"] == "BackoffLimitExceeded" and "flaky-worker-1" in failed["message"]
    # Posted beside the status write, not before it (a CI run read the reasons in between).
    wait_for("the BackoffLimitExceeded event", lambda: "BackoffLimitExceeded" in cluster.reasons("flaky"))
    # cleanPodPolicy Running (default): running and pending pods go, the failed ones stay for their logs.
    wait_for(
        "running pods cleaned",
        lambda: all(
            p.status.phase == "Failed" or p.metadata.deletion_timestamp for p in cluster.pods("flaky").values()
        ),
    )


def test_suspend_and_resume(cluster: Cluster, operator: Operator) -> None:
    cluster.apply("nap", {"replicas": 2})
    cluster.run_all("nap", 2, ip_base=12)
    _phase(cluster, "nap", "Running")
    cluster.patch_spec("nap", {"runPolicy": {"suspend": True}})
    status = _phase(cluster, "nap", "Suspended")
    assert {c["type"]: c["status"] for c in status["conditions"]}["Suspended"] == "True"
    wait_for("pods removed", lambda: not cluster.pods("nap") and not cluster.pods("nap", role="rendezvous"))
    # Resumed with a new step target in the same patch: the pods must start with it (the ConfigMap they
    # mount is updated before the pass that creates them, not in a handler that may run after it).
    cluster.patch_spec("nap", {"runPolicy": {"suspend": False}, "training": {"steps": 777}})
    wait_for("pods back", lambda: len(cluster.pods("nap")) == 2)
    config = cluster.core.read_namespaced_config_map("nap-config", cluster.ns).data["run-config.json"]
    assert json.loads(config)["training"]["steps"] == 777, config
    status = _phase(cluster, "nap", "Pending")
    assert {c["type"]: c["status"] for c in status["conditions"]}["Suspended"] == "False"
    # The operator writes status before it posts the pass's Events (a decision is in status first).
    wait_for("Suspended and Resumed events", lambda: {"Suspended", "Resumed"} <= set(cluster.reasons("nap")))
    assert cluster.core.read_namespaced_config_map("nap-config", cluster.ns)  # kept across the suspension


def test_invalid_spec_fails_naming_the_field(cluster: Cluster, operator: Operator) -> None:
    cluster.apply(
        "bad", {"replicas": 2, "minReplicas": 3, "maxReplicas": 4}
    )  # passes the schema, not the cross-field rules
    status = _phase(cluster, "bad", "Failed")
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["reason"] == "InvalidSpec" and "spec.minReplicas" in failed["message"]
    event = wait_for("InvalidSpec event", lambda: [e for e in cluster.events("bad") if e.reason == "InvalidSpec"])
    assert "spec.minReplicas" in event[0].message and event[0].type == "Warning"
    assert not cluster.pods("bad")


def test_auto_with_a_command_is_warned_of_once_and_still_runs(cluster: Cluster, operator: Operator) -> None:
    passes = operator.passes()
    cluster.apply("cmd", {"replicas": 2, "mode": "auto", "training": {"command": ["python", "train.py"]}})
    warned = wait_for(
        "ModeNotAdjustable event", lambda: [e for e in cluster.events("cmd") if e.reason == "ModeNotAdjustable"]
    )
    assert warned[0].type == "Warning"
    assert warned[0].message.startswith("spec.mode: auto cannot adapt spec.training.command"), warned[0].message
    wait_for("2 worker pods", lambda: len(cluster.pods("cmd")) == 2)  # a warning, not a refusal
    # Every pass reads the spec again; the first posted the Event and two more must not repeat it.
    wait_for("two passes after the warning", lambda: operator.passes() >= passes + 3)
    assert cluster.reasons("cmd").count("ModeNotAdjustable") == 1


def test_operator_restart_adopts_and_delete_cleans_up(cluster: Cluster, operator: Operator) -> None:
    cluster.apply("keep", {"replicas": 3})
    cluster.run_all("keep", 3, ip_base=13)
    _phase(cluster, "keep", "Running")
    before = {n: p.metadata.uid for n, p in cluster.pods("keep").items()}
    rdzv_before = cluster.pods("keep", role="rendezvous")["keep-rdzv"].metadata.uid
    operator.kill()
    cluster.core.delete_namespaced_pod(
        "keep-worker-1", cluster.ns, grace_period_seconds=0
    )  # lost while no operator runs
    operator.start()
    wait_for(
        "worker 1 recreated",
        lambda: (
            "keep-worker-1" in cluster.pods("keep")
            and cluster.pods("keep")["keep-worker-1"].metadata.uid != before["keep-worker-1"]
        ),
    )
    after = {n: p.metadata.uid for n, p in cluster.pods("keep").items()}
    assert set(after) == set(before)  # no duplicates, nothing extra
    assert after["keep-worker-0"] == before["keep-worker-0"] and after["keep-worker-2"] == before["keep-worker-2"]
    assert cluster.pods("keep", role="rendezvous")["keep-rdzv"].metadata.uid == rdzv_before
    assert len(cluster.core.list_namespaced_secret(cluster.ns).items) == 1  # the token was not regenerated

    cluster.plane.kubectl("delete", "sgdjob", "keep", "-n", cluster.ns)
    wait_for(
        "everything gone",
        lambda: (
            not cluster.core.list_namespaced_pod(cluster.ns).items
            and not cluster.core.list_namespaced_config_map(cluster.ns).items
        ),
    )
    assert not [s for s in cluster.core.list_namespaced_secret(cluster.ns).items if s.metadata.name == "keep-control"]
    assert not [s for s in cluster.core.list_namespaced_service(cluster.ns).items if s.metadata.name == "keep"]


def test_liveness_and_operator_metrics(cluster: Cluster, operator: Operator) -> None:
    cluster.apply("seen", {"replicas": 1})
    wait_for("pod", lambda: cluster.pods("seen"))
    wait_for("liveness", lambda: _get(f"http://127.0.0.1:{operator.liveness_port}/healthz"), timeout=30)
    text = wait_for(
        "metrics",
        lambda: (t := _get(f"http://127.0.0.1:{operator.metrics_port}/metrics")) and 'role="worker"' in t and t,
    )
    for name in (
        "sgdjob_operator_reconcile_seconds_count",
        "sgdjob_operator_jobs{",
        "sgdjob_operator_pods_created_total",
        "sgdjob_operator_scrape_errors_total",
    ):
        assert name in text, name


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""
