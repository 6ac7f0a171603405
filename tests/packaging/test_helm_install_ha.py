"""`helm install --set replicaCount=2` on the local cluster (devcluster): two operator pods under exactly
the chart's RBAC; one holds the Lease and runs kopf, the other stands by (healthy, no kopf); deleting the
leader pod hands over to the standby. Every request goes through the recording proxy, so the Lease
rules are checked against what the operator really calls."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from devcluster.cluster import LocalCluster
from devcluster.controlplane import free_port
from devcluster.testing import wait_for
from tests.packaging.recording_proxy import RecordingProxy
from tests.packaging.test_chart import CHART, ROOT
from tests.packaging.test_helm_install import NS, RELEASE, _helm_kc, _operator_pods, chart_permissions
from tests.packaging.test_helm_install import proxy as proxy  # the fixture

T = TypeVar("T")
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{RELEASE}-sgdjob-operator"
STARTED = "sgdjob operator started"


def _name(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def _standby_health(pod: dict[str, Any], port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/healthz", timeout=5) as resp:
            return dict(json.loads(resp.read()))
    except OSError:
        return {}  # not listening yet


def test_two_replicas_elect_one_leader_under_the_charts_rbac_and_hand_over(
    cluster_crd: LocalCluster, proxy: RecordingProxy, tmp_path: Path
) -> None:
    cluster, kube = cluster_crd, cluster_crd.kube()
    health = free_port()
    values = {
        "replicaCount": 2,
        "leaderElection": {"leaseDurationSeconds": 6, "renewDeadlineSeconds": 4, "retryPeriodSeconds": 1},
        "healthPort": health,
        "metrics": {"port": free_port()},
        # Pods share the host's network here, so each binds its own pod IP (a repeated option: the last wins).
        "extraArgs": [
            "--service-account-dir=/var/run/secrets/kubernetes.io/serviceaccount",
            f"--liveness=http://$(POD_IP):{health}/healthz",
            "--metrics-host=$(POD_IP)",
        ],
        "extraEnv": [
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(proxy.port)},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # The pods run the venv's `sgdjob`: make it import this checkout's code, whichever one that is.
            {"name": "PYTHONPATH", "value": f"{ROOT / 'operator' / 'src'}:{ROOT / 'trainer' / 'src'}"},
        ],
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    _helm_kc(
        cluster, "install", RELEASE, str(CHART), "--create-namespace", "-n", NS, "-f", str(tmp_path / "values.yaml")
    )
    try:

        def one_leader() -> tuple[dict[str, Any], dict[str, Any]] | None:
            """(leader, standby) once two pods run and exactly one of them has started kopf."""
            pods = [p for p in _operator_pods(kube) if p.get("status", {}).get("phase") == "Running"]
            started = [p for p in pods if STARTED in cluster.agent.logs(NS, _name(p))]
            if len(pods) != 2 or len(started) != 1:
                return None
            return started[0], next(p for p in pods if p is not started[0])

        def logged(check: Callable[[], T | None], timeout: float, what: str) -> T:
            try:
                return wait_for(check, timeout, what)
            except AssertionError as err:
                logs = {_name(p): cluster.agent.logs(NS, _name(p))[-3000:] for p in _operator_pods(kube)}
                raise AssertionError(f"{err}; pods and log tails: {logs}") from None

        leader, standby = logged(one_leader, 180, "two operator pods, one of them leading")
        holder = wait_for(lambda: kube.get(LEASE)["spec"].get("holderIdentity"), 30, "the lease held")
        assert holder.startswith(_name(leader) + "_")
        expected = {"role": "standby", "leader": holder}  # healthy, and naming the leader it sees
        wait_for(lambda: _standby_health(standby, health) == expected, 30, "the standby's liveness answer")
        assert STARTED not in cluster.agent.logs(NS, _name(standby))

        kube.delete(f"/api/v1/namespaces/{NS}/pods/{_name(leader)}")  # graceful: the lease is handed back
        # The old standby or the Deployment's replacement pod, whichever tries first after the handback.
        new_leader, _ = logged(one_leader, 60, "a standby taking over")
        assert _name(new_leader) != _name(leader)
        assert kube.get(LEASE)["spec"]["holderIdentity"].startswith(_name(new_leader) + "_")
        # Before the uninstall: it deletes the Role while the leader still hands its Lease back (refused
        # then, and harmless: the Lease just expires).
        denied, used = proxy.denied(), proxy.permissions()
    finally:
        _helm_kc(cluster, "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m")
    wait_for(lambda: not _operator_pods(kube), 60, "the operator pods gone")
    assert not denied, f"the chart's RBAC refused the operator: {denied[:5]}"
    leases = {p for p in chart_permissions("--set", "replicaCount=2") if p[0] == "coordination.k8s.io"}
    assert leases and {p for p in used if p[0] == "coordination.k8s.io"} == leases
