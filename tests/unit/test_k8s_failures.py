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
