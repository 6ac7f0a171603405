"""Pods on a lost node: after runPolicy.nodeLostGraceSeconds they are force-deleted, the node is
excluded, an Event names the node, the names are recreated only once free (never two pods of one
index), and none of it spends backoffLimit."""

from __future__ import annotations

import dataclasses

from sgdjob_operator.k8s.nodeloss import NEVER_SEEN, lost_pods, not_ready_since
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import controller, rfc3339
from tests.unit.test_k8s_membership import restarted
from tests.unit.test_status import T0, _spec, pod, rdzv, running


def node(status: str, since: float, reason: str = "NodeStatusUnknown") -> dict[str, object]:
    cond = {"type": "Ready", "status": status, "lastTransitionTime": rfc3339(since), "reason": reason}
    return {"metadata": {"name": "n1"}, "status": {"conditions": [cond]}}


def test_a_node_is_lost_from_when_its_ready_condition_left_true() -> None:
    assert not_ready_since(node("True", T0)) is None
    assert not_ready_since(node("Unknown", T0)) == (T0, "Ready=Unknown (NodeStatusUnknown)")
    assert not_ready_since(node("False", T0, "KubeletNotReady")) == (T0, "Ready=NotReady (KubeletNotReady)")
    assert not_ready_since(None) is None  # deleted: the pod garbage collector's
    assert not_ready_since({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}) == (
        NEVER_SEEN,
        "Ready=Unknown",
    )
    assert not_ready_since({"status": {"conditions": []}}) is None  # still registering


def test_only_pods_past_the_grace_on_a_lost_node_and_still_holding_a_rank_are_lost() -> None:
    pods = [pod(0, node="n1"), pod(1, node="n2"), pod(2, "Succeeded", node="n1")]
    lost = {"n1": (T0, "Ready=Unknown")}
    assert lost_pods(pods, lost, now=T0 + 39, grace_s=40) == []
    (gone,) = lost_pods(pods, lost, now=T0 + 40, grace_s=40)
    assert (gone.pod, gone.node, gone.since) == ("j-worker-0", "n1", T0)


def test_lost_pods_are_force_deleted_with_an_event_then_recreated_off_the_node_unbilled() -> None:
    spec = _spec(replicas=2, runPolicy={"nodeLostGraceSeconds": 30, "backoffLimit": 0})
    store = dataclasses.replace(rdzv(), node="n1")
    pods = [pod(0, node="n1"), pod(1, node="n2"), store]
    lost = {"n1": (T0, "Ready=Unknown (NodeStatusUnknown)")}
    early = plan_reconcile(spec, running(), pods, generation=1, now=T0 + 29, lost_nodes=lost)
    assert early.delete_pods == [] and early.force_delete == set()

    plan = plan_reconcile(spec, running(), pods, generation=1, now=T0 + 30, lost_nodes=lost)
    assert plan.force_delete == {"j-worker-0", "j-rdzv"}
    assert sorted(n for n, _ in plan.delete_pods) == ["j-rdzv", "j-worker-0"]  # each once, no second delete
    # The name is still held: nothing is created in the same pass (never two pods of index 0).
    assert plan.create_workers == [] and not plan.create_rdzv
    events = [e for e in plan.events if e.reason == "NodeLost"]
    assert len(events) == 2 and all("lost with node n1 (Ready=Unknown" in e.message for e in events)
    assert [e.node for e in controller(plan.status).excluded_nodes] == ["n1"]
    assert plan.status.restarts == 0 and plan.status.phase.value == "Running"

    # Next pass: the pods are gone; both are recreated (the worker's builder keeps it off n1).
    after = plan_reconcile(spec, restarted(plan.status), [pod(1, node="n2")], generation=1, now=T0 + 31)
    assert after.create_workers == [0] and after.create_rdzv and after.status.restarts == 0


def test_a_terminating_pod_stuck_on_a_lost_node_is_force_deleted_too() -> None:
    spec = _spec(replicas=1)
    stuck = [pod(0, node="n1", deleting=True), dataclasses.replace(rdzv(), node="n2")]
    plan = plan_reconcile(spec, running(), stuck, generation=1, now=T0 + 40, lost_nodes={"n1": (T0, "Ready=Unknown")})
    assert plan.force_delete == {"j-worker-0"}


def test_a_worker_that_still_answers_on_a_lost_node_is_kept_until_it_stops() -> None:
    """A node whose kubelet stopped with its containers alive: its worker still trains in the world, and
    a replacement of its index would run beside it (two worker-0s) until the kubelet returned to kill
    it. It is kept while it answers the operator; once it stops, it is replaced at once."""
    spec = _spec(replicas=2, runPolicy={"nodeLostGraceSeconds": 30})
    pods = [pod(0, node="n1"), pod(1, node="n2"), dataclasses.replace(rdzv(), node="n2")]
    lost = {"n1": (T0, "Ready=Unknown (NodeStatusUnknown)")}
    kept = plan_reconcile(
        spec, running(), pods, generation=1, now=T0 + 90, lost_nodes=lost, answering=frozenset({"j-worker-0"})
    )
    assert kept.force_delete == set() and kept.delete_pods == [] and not kept.events
    assert controller(kept.status).excluded_nodes == []
    silent = plan_reconcile(spec, running(), pods, generation=1, now=T0 + 95, lost_nodes=lost)
    assert silent.force_delete == {"j-worker-0"} and [e.reason for e in silent.events] == ["NodeLost"]


def test_a_lost_node_ready_again_is_readmitted_and_the_pending_replacement_recreated_for_it() -> None:
    """Two nodes lost, then back (e2e chaos case h): a replacement Pending for want of the lost nodes
    (every other node busy) is recreated once they are Ready again, instead of waiting out the hour
    of policy.excludeNodeSeconds that a slow node's exclusion lasts."""
    spec = _spec(replicas=2, runPolicy={"nodeLostGraceSeconds": 30})
    lost = {"n1": (T0, "Ready=Unknown (NodeStatusUnknown)")}
    plan = plan_reconcile(
        spec, running(), [pod(0, node="n1"), pod(1, node="n2")], generation=1, now=T0 + 30, lost_nodes=lost
    )
    [excluded] = controller(plan.status).excluded_nodes
    assert excluded.node == "n1" and excluded.lost
    status = restarted(plan.status)
    pending = dataclasses.replace(pod(0, "Pending", ready=False), excluded=("n1",))
    still = plan_reconcile(spec, status, [pending, pod(1, node="n2")], generation=1, now=T0 + 60)
    assert still.delete_pods == [] and [e.node for e in controller(still.status).excluded_nodes] == ["n1"]

    back = plan_reconcile(
        spec, status, [pending, pod(1, node="n2")], generation=1, now=T0 + 90, ready_nodes=frozenset({"n1"})
    )
    assert controller(back.status).excluded_nodes == []
    [event] = [e for e in back.events if e.reason == "NodeReadmitted"]
    assert "node n1 Ready again" in event.message and event.type == "Normal"
    assert back.delete_pods == [("j-worker-0", "exclusion of n1 ended; recreated")]


def test_a_slow_nodes_exclusion_outlasts_the_node_being_ready() -> None:
    from sgdjob_operator.k8s.membership import exclude, readmit

    ctl = controller(running())
    exclude(ctl, "slow", T0, 3600, "rank 1 slow on it")
    exclude(ctl, "gone", T0, 3600, "lost", lost=True)
    assert [e.node for e in readmit(ctl, {"slow", "gone"})] == ["gone"]
    assert [e.node for e in ctl.excluded_nodes] == ["slow"]
