"""A node whose kubelet stopped reporting (Ready=Unknown): after runPolicy.nodeLostGraceSeconds the
job's pods there are force-deleted and recreated off the node, with an Event naming it, and the loss
does not spend backoffLimit. The test plays the node controller (it writes the Node's Ready condition)."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from tests.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.k8s


def _node(cluster: Cluster, name: str) -> None:
    cluster.core.create_node({"metadata": {"name": name}})
    _ready(cluster, name, "True")


def _ready(cluster: Cluster, name: str, status: str) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cond = {"type": "Ready", "status": status, "reason": "NodeStatusUnknown", "lastTransitionTime": now}
    cond["lastHeartbeatTime"] = now
    cluster.core.patch_node_status(name, {"status": {"conditions": [cond]}})


def _excluded(pod: Any) -> list[str]:
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    return [v for t in terms for f in t.match_fields or [] for v in f.values]


def test_pods_on_a_lost_node_are_replaced_elsewhere_after_the_grace_unbilled(
    cluster: Cluster, operator: Operator
) -> None:
    lost, healthy = f"{cluster.ns}-a", f"{cluster.ns}-b"
    for name in (lost, healthy):
        _node(cluster, name)
    try:
        cluster.apply("nl", {"replicas": 2, "runPolicy": {"backoffLimit": 0, "nodeLostGraceSeconds": 3}})
        pods = wait_for("2 worker pods", lambda: (p := cluster.pods("nl")) and len(p) == 2 and p)
        cluster.run_pod("nl-worker-0", "127.0.12.2", node=lost)
        cluster.run_pod("nl-worker-1", "127.0.12.3", node=healthy)
        store = wait_for("rendezvous pod", lambda: cluster.pods("nl", role="rendezvous").get("nl-rdzv"))
        cluster.run_pod("nl-rdzv", "127.0.12.4", node=lost)
        wait_for("Running", lambda: cluster.status("nl").get("phase") == "Running")
        old, old_store = pods["nl-worker-0"].metadata.uid, store.metadata.uid

        _ready(cluster, lost, "Unknown")
        failed_at = time.monotonic()
        new = wait_for(
            "worker 0 recreated",
            lambda: (p := cluster.pods("nl").get("nl-worker-0")) is not None and p.metadata.uid != old and p,
            timeout=30,
        )
        took = time.monotonic() - failed_at
        # Within the grace plus a pass (the operator's passes are a second apart at most while it waits).
        assert 2 <= took <= 3 + 10, took  # lastTransitionTime has whole seconds
        assert lost in _excluded(new) and new.spec.node_name is None
        assert cluster.pods("nl")["nl-worker-1"].metadata.uid == pods["nl-worker-1"].metadata.uid
        wait_for(
            "store recreated",
            lambda: (
                (p := cluster.pods("nl", role="rendezvous").get("nl-rdzv")) is not None and p.metadata.uid != old_store
            ),
            timeout=30,
        )
        lost_events = [e.message for e in cluster.events("nl") if e.reason == "NodeLost"]
        assert any("nl-worker-0" in m and f"lost with node {lost} (Ready=Unknown" in m for m in lost_events), (
            lost_events
        )
        status = cluster.status("nl")
        assert status.get("restarts", 0) == 0 and status["phase"] != "Failed", status
        assert lost in [e["node"] for e in status["controller"]["excludedNodes"]]
        print(f"lost node's worker replaced {took:.1f}s after Ready=Unknown (grace 3 s)")
    finally:
        for name in (lost, healthy):
            cluster.core.delete_node(name)


def test_a_worker_still_answering_on_a_lost_node_is_kept_and_replaced_once_silent(
    cluster: Cluster, operator: Operator
) -> None:
    """The node's kubelet stopped, its containers run on (a listener stands in for the trainer's
    metrics port): the worker still trains, so it is kept with one Event saying why; when it stops
    answering it is replaced like any pod of a lost node."""
    lost, healthy = f"{cluster.ns}-c", f"{cluster.ns}-d"
    for name in (lost, healthy):
        _node(cluster, name)
    listener = socket.socket()
    try:
        listener.bind(("127.0.14.2", 9400))
        listener.listen(64)
        cluster.apply("nk", {"replicas": 2, "runPolicy": {"nodeLostGraceSeconds": 2}})
        pods = wait_for("2 worker pods", lambda: (p := cluster.pods("nk")) and len(p) == 2 and p)
        cluster.run_pod("nk-worker-0", "127.0.14.2", node=lost)
        cluster.run_pod("nk-worker-1", "127.0.14.3", node=healthy)
        wait_for("rendezvous pod", lambda: cluster.pods("nk", role="rendezvous").get("nk-rdzv"))
        cluster.run_pod("nk-rdzv", "127.0.14.4", node=healthy)
        wait_for("Running", lambda: cluster.status("nk").get("phase") == "Running")
        old = pods["nk-worker-0"].metadata.uid

        _ready(cluster, lost, "Unknown")
        event = wait_for(
            "an Event that the lost node's worker still answers",
            lambda: next((e.message for e in cluster.events("nk") if e.reason == "NodeLostPodsAnswer"), None),
            timeout=30,
        )
        assert "nk-worker-0" in event and lost in event and "nk-rdzv" not in event, event
        time.sleep(3)  # past the 2-s grace, whose lastTransitionTime has whole seconds
        seen = operator.passes()
        wait_for("two more passes", lambda: operator.passes() >= seen + 2, timeout=30)
        assert cluster.pods("nk")["nk-worker-0"].metadata.uid == old, "an answering worker was replaced"
        assert not [e for e in cluster.events("nk") if e.reason == "NodeLost"]

        listener.close()
        wait_for(
            "worker 0 recreated once silent",
            lambda: (p := cluster.pods("nk").get("nk-worker-0")) is not None and p.metadata.uid != old,
            timeout=30,
        )
        assert any(e.reason == "NodeLost" and "nk-worker-0" in e.message for e in cluster.events("nk"))
        assert cluster.status("nk").get("restarts", 0) == 0
    finally:
        listener.close()
        for name in (lost, healthy):
            cluster.core.delete_node(name)
