"""Two `sgdjob operator --leader-elect` processes against one real kube-apiserver: only the Lease
holder acts, a standby is healthy, a killed leader's standby finishes its mode switch without losing
or repeating a decision or a pod, a clean stop hands over at once, and a leader whose Lease is taken
stops. Short timings (4 s lease, 3 s renew deadline, 0.5 s retry) keep the failover quick."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.operator.conftest import Cluster, Operator, wait_for
from tests.operator.test_adaptation import SWITCH_POLICY, _start

pytestmark = pytest.mark.k8s
LEASE = "sgdjob-operator"
DURATION, DEADLINE, RETRY = 4.0, 3.0, 0.5
FAILOVER_S = DURATION + 2 * RETRY  # lease.Timings.failover_s(): what the chart README documents
TIMINGS = ["--lease-duration", str(DURATION), "--renew-deadline", str(DEADLINE), "--retry-period", str(RETRY)]


def _operator(cluster: Cluster, log_dir: Path, name: str) -> Operator:
    args = ["--leader-elect", "--lease-name", LEASE, "--lease-namespace", cluster.ns, *TIMINGS]
    return Operator(cluster.plane, log_dir / f"{name}.log", args=args, env={"POD_NAME": name})


def _holder(cluster: Cluster) -> str:
    try:
        lease = client.CoordinationV1Api(cluster.core.api_client).read_namespaced_lease(LEASE, cluster.ns)
    except client.ApiException:
        return ""
    return str(lease.spec.holder_identity or "") if lease.spec else ""


def _health(op: Operator) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5) as resp:
            return dict(json.loads(resp.read() or b"{}")) | {"_code": resp.status}
    except OSError:
        return {}


@pytest.fixture
def pair(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[Operator, Operator]]:
    """op-a leads (started first and waited for), op-b stands by."""
    a, b = _operator(cluster, tmp_path, "op-a"), _operator(cluster, tmp_path, "op-b")
    try:
        a.start()
        wait_for("op-a holds the lease", lambda: _holder(cluster).startswith("op-a_"), timeout=60)
        b.start()
        # Its first answer may come before its first read of the Lease (leader still unknown).
        wait_for(
            "op-b a healthy standby that knows the leader",
            lambda: (h := _health(b)).get("role") == "standby" and h.get("leader", "").startswith("op-a_"),
            timeout=60,
        )
        yield a, b
    finally:
        for op in (a, b):
            op.stop()
            print(f"--- {op.log.name} tail ---\n{op.tail(40)}")


def _uids(cluster: Cluster, name: str) -> dict[str, str]:
    return {n: p.metadata.uid for n, p in cluster.pods(name).items()}


def test_only_the_leader_acts_and_a_clean_stop_hands_over(cluster: Cluster, pair: tuple[Operator, Operator]) -> None:
    a, b = pair
    health = _health(b)
    assert health["_code"] == 200 and health["leader"].startswith("op-a_")  # a liveness probe keeps it
    passes = a.passes()
    cluster.apply("ha", {"replicas": 3})
    wait_for("3 pods", lambda: len(cluster.pods("ha")) == 3)
    created = _uids(cluster, "ha")
    # The job's first pass made the pods; the second (their events wake it) must leave them be, and a
    # standby that acted would have had those same events to act on.
    wait_for("op-a's second pass over the job", lambda: a.passes() >= passes + 2)
    assert _uids(cluster, "ha") == created
    assert b.passes() == 0, "the standby reconciled a job"
    assert "sgdjob operator started" in a.log.read_text() and "sgdjob operator started" not in b.log.read_text()
    assert "sgdjob_operator_leader 1.0" in a.metrics() and "sgdjob_operator_leader 0.0" in b.metrics()

    start = time.monotonic()
    a.stop()  # SIGTERM, as a rolling update sends: the lease is handed back, not waited out
    wait_for("op-b takes over", lambda: _holder(cluster).startswith("op-b_"), timeout=30, interval=0.1)
    assert time.monotonic() - start < DURATION
    wait_for("op-b's kopf started", lambda: "sgdjob operator started" in b.log.read_text(), timeout=30)
    cluster.patch_spec("ha", {"replicas": 4})
    wait_for("the new leader scales", lambda: len(cluster.pods("ha")) == 4)
    assert {n: u for n, u in _uids(cluster, "ha").items() if n in created} == created


def test_killing_the_leader_mid_switch_loses_and_repeats_nothing(
    cluster: Cluster, pair: tuple[Operator, Operator]
) -> None:
    a, _ = pair
    spec = {"mode": "auto", "policy": SWITCH_POLICY}
    fleet = _start(cluster, "hasw", spec, [0.02, 0.02, 0.02, 0.06], subnet=30)
    try:
        status = wait_for(
            "a switch decision",
            lambda: s if (s := cluster.status("hasw")).get("targetMode") not in (None, "sync") else None,
            timeout=90,
        )
        target = status["targetMode"]
        posts = wait_for("pushes", lambda: list(fleet.offered) if len(fleet.offered) >= 2 else None, timeout=30)
        pods = _uids(cluster, "hasw")
        decisions = cluster.status("hasw")["decisions"]

        start = time.monotonic()
        a.kill()  # kill -9 mid-switch: decided and pushed, the workers not yet switched
        wait_for("op-b takes over", lambda: _holder(cluster).startswith("op-b_"), timeout=60, interval=0.1)
        took = time.monotonic() - start
        assert took <= FAILOVER_S + 1.0, f"failover took {took:.1f}s, documented bound {FAILOVER_S}s"
        seen = len(fleet.offered)
        wait_for("the new leader re-pushes", lambda: len(fleet.offered) > seen, timeout=60)
        assert all(p == posts[-1] for p in fleet.offered[seen:])  # the same command, same epoch
        assert cluster.status("hasw")["decisions"] == decisions

        applied = fleet.apply()  # the workers switch at a step boundary and report it
        assert applied is not None and applied.mode is not None and applied.mode.value == target
        status = wait_for(
            "mode follows",
            lambda: s if (s := cluster.status("hasw")).get("mode") == target and s.get("phase") == "Running" else None,
            timeout=60,
        )
        switches = [d for d in status["decisions"] if d["action"] == "switchMode"]
        assert status["decisions"] == decisions and len(switches) == 1 and switches[0]["mode"] == target
        wait_for("ModeSwitched event", lambda: "ModeSwitched" in cluster.reasons("hasw"))
        assert cluster.reasons("hasw").count("SwitchMode") == 1  # decided once, announced once
        assert _uids(cluster, "hasw") == pods  # no pod duplicated or re-created
    finally:
        fleet.stop()


def test_a_leader_whose_lease_is_taken_stops(cluster: Cluster, tmp_path: Path) -> None:
    op = _operator(cluster, tmp_path, "op-a").start()
    try:
        wait_for("op-a holds the lease", lambda: _holder(cluster).startswith("op-a_"), timeout=60)
        api = client.CoordinationV1Api(cluster.core.api_client)
        lease = api.read_namespaced_lease(LEASE, cluster.ns)
        assert lease.spec is not None
        lease.spec.holder_identity, lease.spec.lease_duration_seconds = "intruder", 60
        api.replace_namespaced_lease(LEASE, cluster.ns, lease)
        assert op.proc is not None
        code = wait_for("op-a exits", lambda: op.proc.poll() if op.proc else None, timeout=DEADLINE + 5)
        assert code == 3 and "lost the lease" in op.log.read_text()
    finally:
        op.stop()
