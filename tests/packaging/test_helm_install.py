"""`helm install`, `helm upgrade`, `helm uninstall` of the chart on the local cluster (devcluster): the
operator pod runs through the node agent with in-cluster config (its ServiceAccount's token Secret,
mounted by the admission plugin) under exactly the chart's RBAC, and reconciles a one-worker SGDJob
to Succeeded.

Every API request the operator pod makes goes through a recording proxy (its
`KUBERNETES_SERVICE_PORT` points there), so the test also derives what the code calls, kopf's own
watches and patches included, and compares it with the chart's rules: no missing verb (no 403), no
unused one, no wildcard.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import yaml

from devcluster.cluster import LocalCluster
from devcluster.controlplane import free_port
from devcluster.kube import KubeApi
from devcluster.testing import new_namespace, wait_for
from tests.packaging.recording_proxy import RecordingProxy
from tests.packaging.test_chart import CHART, _helm, _render

RELEASE, NS = "sgdjob", "sgdjob-system"
HOLD = "sgdjob.test/hold"  # a finalizer that keeps the job's objects until the operator's clean-up has run


def expand(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def chart_permissions(*options: str) -> set[tuple[str, str, str]]:
    """What the chart grants the operator in a cluster-wide install (ClusterRole rules, expanded)."""
    roles = [d for d in _render(*options) if d["kind"] in ("ClusterRole", "Role")]
    perms = set().union(*(expand(r["rules"]) for r in roles))
    assert not {p for p in perms if "*" in p}, "wildcards in the chart's RBAC"
    return perms


class HasKubeconfig(Protocol):
    @property
    def kubeconfig(self) -> Path: ...


def _helm_kc(cluster: HasKubeconfig, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`helm` against a local cluster, the process-node one or the real-node one; fails with its output."""
    result = subprocess.run(
        [_helm(), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args[:2])}: {result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def proxy(cluster_crd: LocalCluster) -> Iterator[RecordingProxy]:
    certs = cluster_crd.plane.workdir / "certs"
    recorder = RecordingProxy(
        upstream=cluster_crd.plane.server, cert=certs / "apiserver.crt", key=certs / "apiserver.key", port=free_port()
    ).start()
    try:
        yield recorder
    finally:
        recorder.stop()


def _operator_pods(kube: KubeApi) -> list[dict[str, Any]]:
    pods = kube.get(f"/api/v1/namespaces/{NS}/pods", labelSelector=f"app.kubernetes.io/instance={RELEASE}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _running_operator(cluster: LocalCluster, kube: KubeApi, not_uid: str = "") -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pods = [
            p
            for p in _operator_pods(kube)
            if p["metadata"]["uid"] != not_uid and p.get("status", {}).get("phase") == "Running"
        ]
        return pods[0] if pods else None

    pod = wait_for(ready, 120, "the operator pod running")
    wait_for(
        lambda: "sgdjob operator started" in cluster.agent.logs(NS, pod["metadata"]["name"]),
        120,
        "the operator started",
    )
    return pod


def _job(ckpt: Path) -> dict[str, Any]:
    return {
        "apiVersion": "sgdjob.dev/v1alpha1",
        "kind": "SGDJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 1,
            "mode": "sync",
            "training": {
                "model": "mlp",
                "dataset": "synthetic",
                "batchSize": 8,
                "steps": 20,
                "checkpoint": {"dir": str(ckpt)},
                "emulation": {"computeSeconds": 0.01},
            },
            "policy": {"intervalSeconds": 1},
            # Created suspended and then resumed with more steps: the new generation is written to the
            # ConfigMap made for the first, the chart's one use of configmaps/patch that does not hang
            # on timing (the policy-state ConfigMap is written twice only if the policy runs twice).
            "runPolicy": {"suspend": True},
        },
    }


def test_helm_install_upgrade_uninstall_runs_a_job_under_exactly_the_charts_rbac(
    cluster_crd: LocalCluster, proxy: RecordingProxy, tmp_path: Path
) -> None:
    cluster, kube = cluster_crd, cluster_crd.kube()
    values = {
        "healthPort": free_port(),
        "metrics": {"port": free_port()},
        # The node agent mounts the token Secret in a folder of its own and rewrites the path in args.
        "extraArgs": ["--service-account-dir=/var/run/secrets/kubernetes.io/serviceaccount", "--resync=1"],
        "extraEnv": [{"name": "KUBERNETES_SERVICE_PORT", "value": str(proxy.port)}],
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    base = ["-n", NS, "-f", str(tmp_path / "values.yaml"), "--wait", "--timeout", "4m"]
    _helm_kc(cluster, "install", RELEASE, str(CHART), "--create-namespace", *base)
    try:
        first = _running_operator(cluster, kube)
        ns = new_namespace(kube, "helm")
        job = _job(tmp_path / "ckpt")
        cluster.plane.kubectl("-n", ns, "apply", "-f", "-", input_text=yaml.safe_dump(job))
        path = f"/apis/sgdjob.dev/v1alpha1/namespaces/{ns}/sgdjobs/tiny"
        config = f"/api/v1/namespaces/{ns}/configmaps/tiny-config"
        wait_for(lambda: kube.get_or_none(config), 120, "the suspended job's ConfigMap")
        cluster.plane.kubectl(
            "-n", ns, "patch", "sgdjob", "tiny", "--type=merge",
            "-p", '{"spec":{"runPolicy":{"suspend":false},"training":{"steps":24}}}',
        )  # fmt: skip

        def phase() -> str | None:
            obj = kube.get_or_none(path)
            value = (obj or {}).get("status", {}).get("phase")
            assert value != "Failed", obj
            return value if value == "Succeeded" else None

        wait_for(phase, 240, "the SGDJob Succeeded")

        # Hold the job's objects, so the operator's own clean-up after the deletion is seen whatever
        # the garbage collector does first.
        held = cluster.plane.kubectl(
            "-n", ns, "get", "service,secret,configmap", "-l", "sgdjob.dev/job-name=tiny", "-o", "name"
        ).stdout.split()
        # The policy's state ConfigMap exists once the policy has evaluated the job (it may finish before).
        made = {"service/tiny", "secret/tiny-control", "configmap/tiny-config"}
        assert made <= set(held) <= made | {"configmap/tiny-policy-state"}, held
        for name in held:
            cluster.plane.kubectl(
                "-n", ns, "patch", name, "--type=merge", "-p", f'{{"metadata":{{"finalizers":["{HOLD}"]}}}}'
            )

        _helm_kc(cluster, "upgrade", RELEASE, str(CHART), *base, "--set-string", "podAnnotations.upgraded=yes")
        second = _running_operator(cluster, kube, not_uid=first["metadata"]["uid"])
        assert second["metadata"]["annotations"]["upgraded"] == "yes"
        assert [p["metadata"]["uid"] for p in _operator_pods(kube)] == [
            second["metadata"]["uid"]
        ]  # Recreate: one operator

        # The upgraded operator deletes the finished job (ttl 0) and then the job's objects.
        cluster.plane.kubectl(
            "-n",
            ns,
            "patch",
            "sgdjob",
            "tiny",
            "--type=merge",
            "-p",
            '{"spec":{"runPolicy":{"ttlSecondsAfterFinished":0}}}',
        )
        wait_for(lambda: kube.get_or_none(path) is None, 120, "the job deleted by its TTL")
        # nodes get: each pass reads the Nodes its pods are on (a lost node's pods are replaced).
        wanted = {("", "services", "delete"), ("", "secrets", "delete"), ("", "configmaps", "delete")}
        wanted.add(("", "nodes", "get"))
        wait_for(lambda: wanted <= proxy.permissions(), 60, "the operator's clean-up of the job's objects")
        for name in held:
            cluster.plane.kubectl(
                "-n", ns, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )
    finally:
        _helm_kc(cluster, "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m")
    wait_for(lambda: not _operator_pods(kube), 60, "the operator pod gone")
    left = cluster.plane.kubectl(
        "get", "clusterrole,clusterrolebinding", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name"
    ).stdout.strip()
    assert (
        not left
        and not cluster.plane.kubectl(
            "-n", NS, "get", "deploy,sa,svc", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name"
        ).stdout.strip()
    )
    assert cluster.plane.kubectl("get", "crd", "sgdjobs.sgdjob.dev", "-o", "name").returncode == 0  # Helm keeps CRDs

    denied = proxy.denied()
    assert not denied, f"the chart's RBAC refused the operator: {denied[:5]}"
    used, granted = proxy.permissions(), chart_permissions()
    assert used == granted, (
        f"missing from the chart: {sorted(used - granted)}; granted but never used: {sorted(granted - used)}"
    )
