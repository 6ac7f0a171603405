"""The generated CRD on a real kube-apiserver, exercised through kubectl as a user would."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from devcluster.controlplane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sgdjob.dev/v1alpha1",
        "kind": "SGDJob",
        "metadata": {"name": name},
        "spec": {"replicas": 2, **spec},
    }


def _apply(k8s: ControlPlane, doc: dict[str, Any], *extra: str) -> Any:
    return k8s.kubectl("apply", "-f", "-", *extra, check=False, input_text=yaml.safe_dump(doc))


def test_crd_is_established(k8s_crd: ControlPlane) -> None:
    out = k8s_crd.kubectl("get", "crd", "sgdjobs.sgdjob.dev", "-o", "json").stdout
    conditions = {c["type"]: c["status"] for c in json.loads(out)["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_server_side_dry_run(k8s_crd: ControlPlane, example: Path) -> None:
    result = k8s_crd.kubectl("apply", "--dry-run=server", "-f", str(example), check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"mode": "fastest"}, "spec.mode"),
        ({"replicas": 0}, "spec.replicas"),
        ({"replicas": -3}, "spec.replicas"),
        ({"replicas": 2.5}, "spec.replicas"),
        ({"replicas": 5000}, "spec.replicas"),
        ({"nprocPerNode": 0}, "spec.nprocPerNode"),
        ({"training": {"learningRate": 0}}, "spec.training.learningRate"),
        ({"training": {"batchSize": 10**7}}, "spec.training.batchSize"),
        ({"policy": {"intervalSeconds": 0.01}}, "spec.policy.intervalSeconds"),
        ({"policy": {"allowedActions": ["explode"]}}, "spec.policy.allowedActions"),
        ({"runPolicy": {"cleanPodPolicy": "Sometimes"}}, "spec.runPolicy.cleanPodPolicy"),
    ],
)
def test_server_rejects_bad_fields_naming_them(k8s_crd: ControlPlane, spec: dict[str, Any], field: str) -> None:
    result = _apply(k8s_crd, _job(f"bad-{uuid.uuid4().hex[:8]}", **spec), "--dry-run=server")
    assert result.returncode != 0
    assert field in result.stderr, result.stderr


def test_kubectl_validation_rejects_unknown_field(k8s_crd: ControlPlane) -> None:
    result = _apply(k8s_crd, _job("typo", replica=3))
    assert result.returncode != 0
    assert "unknown field" in result.stderr and "replica" in result.stderr, result.stderr


def test_get_shows_columns_and_scale_changes_replicas(k8s_crd: ControlPlane) -> None:
    name = "cols"
    assert _apply(k8s_crd, _job(name)).returncode == 0
    header = k8s_crd.kubectl("get", "sgdjobs").stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "MODE", "READY", "STEP", "STRAGGLERS", "ETA", "AGE"]
    wide = k8s_crd.kubectl("get", "sgdj", "-o", "wide").stdout.splitlines()[0].split()
    assert {"TARGET", "BATCHES", "LOSS", "ETA-TO"} <= set(wide), wide

    # Status is a subresource: what the operator writes there shows in the columns.
    api = client.CustomObjectsApi(config.new_client_from_config(str(k8s_crd.kubeconfig)))
    status = {
        "status": {
            "phase": "Running",
            "mode": "sync",
            "modeSummary": "sync (rebalanced)",
            "batches": "40/40/16",
            "ready": "2/2",
            "step": 42,
            "stragglerCount": 1,
            "loss": 0,
            "eta": "4m10s",
        }
    }
    api.patch_namespaced_custom_object_status("sgdjob.dev", "v1alpha1", "default", "sgdjobs", name, status)
    # A spec write revalidates the stored status, an integral loss included (it once overflowed the bound).
    k8s_crd.kubectl(
        "patch", "sgdjob", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"ttlSecondsAfterFinished":0}}}'
    )
    row = k8s_crd.kubectl("get", "sgdjob", name, "--no-headers").stdout.split()
    assert row[:8] == [name, "Running", "sync", "(rebalanced)", "2/2", "42", "1", "4m10s"]
    assert "40/40/16" in k8s_crd.kubectl("get", "sgdjob", name, "-o", "wide").stdout

    k8s_crd.kubectl("scale", f"sgdjob/{name}", "--replicas=3")
    spec = json.loads(k8s_crd.kubectl("get", "sgdjob", name, "-o", "json").stdout)["spec"]
    assert spec["replicas"] == 3
    # Defaults from the models are applied by the server.
    assert (
        spec["mode"] == "auto" and spec["training"]["batchSize"] == 32 and spec["policy"]["persistenceIntervals"] == 3
    )
    k8s_crd.kubectl("delete", "sgdjob", name)


def test_explain_has_field_text(k8s_crd: ControlPlane) -> None:
    out = k8s_crd.kubectl("explain", "sgdjob.spec").stdout
    assert "Desired state of an SGDJob" in out
    assert "minReplicas" in out and "torchrun --nnodes min" in out
    out = k8s_crd.kubectl("explain", "sgdjob.spec.policy.stragglerThreshold").stdout
    assert "exceeds the median" in out


def test_worker_and_store_pods_kept_off_two_lost_nodes_are_accepted_by_the_api_server(k8s: ControlPlane) -> None:
    """Two nodes excluded at once (two lost one after the other, e2e chaos case h): the pods the
    operator builds pass the API server's validation (server-side dry run), which allows one value
    per node field selector."""
    from sgdjob_operator.api.validation import validate_spec
    from sgdjob_operator.k8s.builders import JobRef, build_rdzv_pod, build_worker_pod

    spec = validate_spec({"replicas": 3, "minReplicas": 1})
    ref = JobRef(name="two-lost", namespace="default", uid="u-1")
    lost = ["node-0", "node-2"]
    k8s.kubectl("create", "serviceaccount", "default", "-n", "default", check=False)  # no controller-manager here
    for pod in (
        build_worker_pod(ref, spec, 1, default_image="img", excluded_nodes=lost),
        build_rdzv_pod(ref, spec, default_image="img", excluded_nodes=lost),
    ):
        result = k8s.kubectl("apply", "--dry-run=server", "-f", "-", check=False, input_text=json.dumps(pod))
        assert result.returncode == 0, result.stderr
