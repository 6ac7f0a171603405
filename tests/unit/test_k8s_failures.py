"""Failure accounting: the infrastructure's faults (evicted, deleted, lost node, closed, timed-out or
moved rendezvous, a vanished peer) are retried without spending backoffLimit; the user's crash counts, and
the job's message names the root cause, not the pod's log tail."""

from __future__ import annotations

import dataclasses

import pytest

from sgdjob_operator.api.models import Phase
from sgdjob_operator.k8s.failures import classify
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import PodView
from tests.unit.test_status import T0, _spec, pod, rdzv, running

LOST = {"n0": (T0, "Ready=Unknown (NodeStatusUnknown)")}


def failed(code: int | None = 1, *, node: str = "n1", reason: str = "Error", deleting: bool = False) -> PodView:
    p = pod(1, "Failed", node=node, reason=reason, deleting=deleting)
    return dataclasses.replace(p, exit_code=code, message="Traceback ...\nRuntimeError: boom")


def store(node: str | None = "n2", phase: str = "Running", ready: bool = True) -> PodView:
    return dataclasses.replace(rdzv(), node=node, phase=phase, ready=ready)


@pytest.mark.parametrize(
    ("victim", "others", "counted", "cause"),
    [
        (
            failed(),
            [pod(0, node="n2"), store()],
            True,
            "worker pod j-worker-1 failed (exit code 1, Error); see its log",
        ),
        (failed(137, reason="OOMKilled"), [store()], True, "exit code 137, OOMKilled"),
        (failed(reason="Evicted"), [store()], False, "j-worker-1 Evicted by the cluster"),
        (failed(143, deleting=True), [store()], False, "deleted while it ran (exit code 143)"),
        (failed(node="n0"), [store()], False, "lost with node n0 (Ready=Unknown (NodeStatusUnknown) since "),
        (failed(3), [store()], False, "found the job's rendezvous closed (exit code 3)"),
        (
            failed(4),
            [store()],  # the peer's pods force-deleted, its node no longer among the lost
            False,
            "worker pod j-worker-1 could not form a world: fewer than minReplicas workers joined its "
            "rendezvous in time (exit code 4)",
        ),
        (failed(), [store(node="n0")], False, "rendezvous store on node n0 (Ready=Unknown"),
        (failed(), [], False, "rendezvous store being replaced"),
        (failed(), [store(), pod(0, node="n0")], False, "after its peer j-worker-0 was lost with node n0"),
    ],
)
def test_exit_codes_reasons_and_nodes_decide_what_counts(
    victim: PodView, others: list[PodView], counted: bool, cause: str
) -> None:
    verdict = classify(victim, [victim, *others], LOST)
    assert verdict.counted is counted and cause in verdict.cause
    assert "Traceback" not in verdict.cause


def test_a_store_that_never_starts_still_ends_a_crash_loop() -> None:
    pending = store(phase="Pending", ready=False, node=None)
    assert classify(failed(), [failed(), pending], {}).counted


def test_the_failed_jobs_message_names_the_root_cause_and_only_crashes_count() -> None:
    spec = _spec(runPolicy={"backoffLimit": 0})
    lost_peer = [failed(), pod(0, node="n0"), store()]
    plan = plan_reconcile(spec, running(), lost_peer, generation=1, now=T0 + 1, lost_nodes=LOST)
    assert plan.status.restarts == 0 and plan.status.phase is not Phase.FAILED
    crash = [dataclasses.replace(failed(), uid="u2"), pod(0, node="n2"), store()]
    final = plan_reconcile(spec, plan.status, crash, generation=1, now=T0 + 2)
    assert final.status.phase is Phase.FAILED and final.status.restarts == 1
    message = {c.type: c for c in final.status.conditions}["Failed"].message
    assert message.endswith("last: worker pod j-worker-1 failed (exit code 1, Error); see its log"), message


def test_a_timed_out_rendezvous_is_free_but_the_crashing_peer_it_waited_for_counts() -> None:
    spec = _spec(runPolicy={"backoffLimit": 1})
    survivor = dataclasses.replace(failed(4), uid="u-survivor")
    plan = plan_reconcile(spec, running(), [survivor, store()], generation=1, now=T0 + 1)
    assert plan.status.restarts == 0 and plan.status.phase is not Phase.FAILED
    crashing = [
        dataclasses.replace(pod(0, "Failed", node="n2", reason="Error", uid=f"u-peer-{life}"), exit_code=1)
        for life in (1, 2)
    ]
    status = plan.status
    for life, peer in enumerate(crashing, start=2):
        status = plan_reconcile(spec, status, [peer, survivor, store()], generation=1, now=T0 + life).status
    assert status.phase is Phase.FAILED and status.restarts == 2
    message = {c.type: c for c in status.conditions}["Failed"].message
    assert message.endswith("last: worker pod j-worker-0 failed (exit code 1, Error); see its log"), message


def test_a_closed_rendezvous_gets_a_new_store_so_backoff_limit_can_end_a_crash_loop() -> None:
    """The agents of a script that crashed over and over spent their restarts and closed the rendezvous;
    every new pod then exits 3 (not counted) at once. The store goes, so the next world forms on a
    fresh one and backoffLimit counts the crashes (before: new pods every few seconds, forever)."""
    spec = _spec(runPolicy={"backoffLimit": 3})
    old_store = dataclasses.replace(store(), created=T0)
    turned_away = dataclasses.replace(failed(3), uid="u-closed", created=T0 + 30)
    plan = plan_reconcile(spec, running(), [turned_away, pod(0, node="n2"), old_store], generation=1, now=T0 + 40)
    assert ("j-rdzv", "rendezvous closed; recreated") in plan.delete_pods
    assert plan.status.restarts == 0 and plan.status.phase is not Phase.FAILED
    (event,) = [e for e in plan.events if e.reason == "RendezvousClosed"]
    assert event.type == "Warning" and "j-worker-1 exited with code 3" in event.message
    move = plan.status.controller.store_move if plan.status.controller else None
    assert move is not None and move.node is None, "the store's node is healthy: nothing to stay off"

    # The pods of the closed world fail next: the store's doing, not counted; the new store is kept.
    new_store = dataclasses.replace(store(), uid="u-new-store", created=T0 + 42)
    stale = dataclasses.replace(pod(0, "Failed", node="n2", reason="Error", uid="u-stale"), exit_code=3, created=T0)
    again = plan_reconcile(spec, plan.status, [stale, new_store], generation=1, now=T0 + 45)
    assert not [name for name, _ in again.delete_pods if name == "j-rdzv"] and again.status.restarts == 0

    # In the new world the script crashes again: counted, until backoffLimit fails the job.
    status = again.status
    for life in range(1, 5):
        crash = dataclasses.replace(failed(), uid=f"u-crash-{life}", created=T0 + 50 + life)
        status = plan_reconcile(spec, status, [crash, new_store], generation=1, now=T0 + 60 + life).status
    assert status.phase is Phase.FAILED and status.restarts == 4


def test_a_closed_rendezvous_after_training_ended_or_an_older_store_changes_nothing() -> None:
    spec = _spec()
    late = dataclasses.replace(failed(3), uid="u-late", created=T0 + 30)
    done = dataclasses.replace(pod(0, "Succeeded", node="n2"), exit_code=0)
    plan = plan_reconcile(
        spec, running(), [late, done, dataclasses.replace(store(), created=T0)], generation=1, now=T0 + 40
    )
    assert not [e for e in plan.events if e.reason == "RendezvousClosed"], "the world ended because training did"
    # A pod created before the store was: it joined the old store, which was replaced already.
    older = dataclasses.replace(failed(3), uid="u-old", created=T0)
    plan = plan_reconcile(
        spec, running(), [older, dataclasses.replace(store(), created=T0 + 5)], generation=1, now=T0 + 40
    )
    assert not [e for e in plan.events if e.reason == "RendezvousClosed"]
