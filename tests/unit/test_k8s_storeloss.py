"""A rendezvous store that stops answering: re-homed after runPolicy.storeLostGraceSeconds while the job
makes no progress, kept off its old node, and no worker failure it causes spends backoffLimit; a store
the operator never reached, or one the workers still train through, is left alone."""

from __future__ import annotations

import dataclasses

from sgdjob_operator.k8s.builders import JobRef, build_rdzv_pod
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import PodView, SGDJobStatus, controller
from sgdjob_operator.k8s.storeloss import store_excluded
from tests.unit.test_k8s_membership import restarted
from tests.unit.test_status import T0, _spec, pod, rdzv, running

SPEC = _spec(replicas=3, minReplicas=2, runPolicy={"storeLostGraceSeconds": 15, "backoffLimit": 0})
STORE = dataclasses.replace(rdzv(), node="n0", uid="store-1")


def world(*extra: PodView) -> list[PodView]:
    return [pod(0, node="n0"), pod(1, node="n1"), pod(2, node="n2"), STORE, *extra]


def passes(st: SGDJobStatus, answers: list[tuple[float, bool]], pods: list[PodView], step: int = 100) -> list:
    """One plan per (time, answered), each from the status the last one wrote, as the API returns it."""
    plans = []
    for t, answered in answers:
        st.step = step
        plan = plan_reconcile(SPEC, st, pods, generation=1, now=T0 + t, store_answered=answered)
        plans.append(plan)
        st = restarted(plan.status)
    return plans


def test_a_silent_store_that_answered_before_is_re_homed_after_the_grace_while_the_job_stalls() -> None:
    plans = passes(running(), [(0, True), (1, False), (10, False), (15.9, False), (16, False)], world())
    assert all(p.force_delete == set() for p in plans[:4])
    last = plans[-1]
    assert last.force_delete == {"j-rdzv"} and [n for n, _ in last.delete_pods] == ["j-rdzv"]
    (event,) = [e for e in last.events if e.reason == "StoreLost"]
    assert event.type == "Warning" and "j-rdzv on node n0" in event.message and "off node n0" in event.message
    assert "no progress past step 100" in event.message
    move = controller(last.status).store_move
    assert move is not None and move.node == "n0" and controller(last.status).store_silence is None
    assert last.status.restarts == 0 and last.status.phase.value == "Running"
    # The replacement stays off the old node, which the scheduler still takes for Ready.
    avoid = store_excluded(controller(last.status), [])
    built = build_rdzv_pod(JobRef("ns", "j", "u"), SPEC, default_image="img", excluded_nodes=avoid)
    term = built["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["n0"]}
    ]


def test_a_store_the_operator_never_reached_is_never_judged() -> None:
    plans = passes(running(), [(0, False), (20, False), (100, False)], world())
    assert all(p.force_delete == set() and not p.events for p in plans)


def test_progress_while_silent_means_the_workers_still_have_their_store() -> None:
    st = running()
    plans = passes(st, [(0, True), (1, False)], world(), step=100)
    st = restarted(plans[-1].status)
    # The operator's own path to the store fails, the job goes on: the count starts over at each step.
    for t, step in [(10, 150), (20, 200), (30, 250)]:
        st.step = step
        plan = plan_reconcile(SPEC, st, world(), generation=1, now=T0 + t, store_answered=False)
        assert plan.force_delete == set(), t
        st = restarted(plan.status)
    assert controller(st).store_silence is not None and controller(st).store_silence.step == 250


def test_an_answer_ends_the_silence_and_a_new_store_pod_starts_unjudged() -> None:
    plans = passes(running(), [(0, True), (1, False), (10, True), (20, False)], world())
    assert controller(plans[2].status).store_silence is None
    assert controller(plans[3].status).store_silence is not None  # counted from t=20, not t=1
    assert plans[3].force_delete == set()
    fresh = dataclasses.replace(STORE, uid="store-2")
    st = restarted(plans[3].status)
    plan = plan_reconcile(SPEC, st, [*world()[:3], fresh], generation=1, now=T0 + 60, store_answered=False)
    assert plan.force_delete == set()  # store-2 never answered: not comparable


def test_worker_failures_while_the_store_is_silent_or_after_it_moved_spend_nothing() -> None:
    plans = passes(running(), [(0, True), (1, False)], world())
    st = restarted(plans[-1].status)
    crashed = dataclasses.replace(pod(1, "Failed", node="n1"), created=T0 - 100)
    plan = plan_reconcile(
        SPEC, st, [*world()[:1], crashed, *world()[2:]], generation=1, now=T0 + 5, store_answered=False
    )
    (event,) = [e for e in plan.events if e.reason == "WorkerFailed"]
    assert "rendezvous store not answering since" in event.message and "not counted: infrastructure" in event.message
    assert plan.status.restarts == 0 and plan.status.phase.value == "Adapting"  # recreated, not Failed

    # After the move, a worker whose agent held the old store fails once the store is back: free too.
    st = restarted(passes(restarted(plan.status), [(20, False)], world())[-1].status)
    assert controller(st).store_move is not None
    new_store = dataclasses.replace(STORE, uid="store-2", node="n1")
    late = dataclasses.replace(pod(2, "Failed", node="n2", uid="late"), created=T0 - 100)
    plan = plan_reconcile(
        SPEC, st, [pod(0, node="n0"), late, new_store], generation=1, now=T0 + 40, store_answered=True
    )
    (event,) = [e for e in plan.events if e.reason == "WorkerFailed"]
    assert "its rendezvous store was re-homed from node n0" in event.message and plan.status.restarts == 0

    # A worker created after the move that crashes is the job's own failure: backoffLimit 0 is spent.
    mine = dataclasses.replace(pod(2, "Failed", node="n2", uid="mine"), created=T0 + 30)
    plan = plan_reconcile(
        SPEC, st, [pod(0, node="n0"), mine, new_store], generation=1, now=T0 + 40, store_answered=True
    )
    assert plan.status.restarts == 1 and plan.status.phase.value == "Failed"


def test_a_store_that_still_answers_on_a_lost_node_is_kept_and_a_silent_one_is_not() -> None:
    # The kubelet of n0 stopped reporting, its containers run on: the store there still answers.
    spec = _spec(replicas=3, minReplicas=2, runPolicy={"nodeLostGraceSeconds": 30})
    lost = {"n0": (T0, "Ready=Unknown (NodeStatusUnknown)")}
    kept = plan_reconcile(
        spec, running(), world(), generation=1, now=T0 + 31, lost_nodes=lost, store_answered=True,
        answering=frozenset({"j-rdzv"}),
    )  # fmt: skip
    assert kept.force_delete == {"j-worker-0"}, "the silent worker there is replaced, the answering store is not"
    gone = plan_reconcile(spec, running(), world(), generation=1, now=T0 + 31, lost_nodes=lost, store_answered=False)
    assert gone.force_delete == {"j-worker-0", "j-rdzv"}
    assert controller(gone.status).store_move is not None


def test_workers_still_held_by_a_re_homed_store_are_restarted_once_it_is_clear_they_wait_for_good() -> None:
    """A cut network drops packets and sends no resets: the agents that joined the old store wait on its
    connection for good. Workers created before the move and still running, with the job not past the
    step it had at the move, are restarted after STRANDED_GRACES store graces; not before, and not at
    all once training went on (a power cut's survivors exit and rejoin by themselves)."""
    spec = _spec(replicas=3, minReplicas=2, runPolicy={"storeLostGraceSeconds": 10})
    st = running()
    st.step = 100
    store = next(p for p in world() if p.name == "j-rdzv")
    controller(st).store_answered = store.uid
    for t in (0, 5, 11):
        plan = plan_reconcile(spec, st, world(), generation=1, now=T0 + t, store_answered=False)
        st = plan.status
    assert "j-rdzv" in plan.force_delete and controller(st).store_move is not None
    moved_at = T0 + 11
    held = [dataclasses.replace(p, created=T0 - 60) for p in world() if p.name != "j-rdzv"]
    fresh_store = dataclasses.replace(rdzv(), uid="new", node="n1")
    early = plan_reconcile(spec, st, [*held, fresh_store], generation=1, now=moved_at + 59, store_answered=True)
    assert early.delete_pods == []
    late = plan_reconcile(spec, st, [*held, fresh_store], generation=1, now=moved_at + 60, store_answered=True)
    assert sorted(n for n, _ in late.delete_pods) == ["j-worker-0", "j-worker-1", "j-worker-2"]
    assert late.force_delete == set(), "their nodes are fine: a graceful stop"
    (event,) = [e for e in late.events if e.reason == "WorkersStranded"]
    assert "made no progress from step 100" in event.message and "old store" in event.message
    assert late.status.restarts == st.restarts
    # Training went on after the move, or resumed from an earlier checkpoint: nothing to do.
    for resumed in (101, 90):
        st.step = resumed
        went_on = plan_reconcile(spec, st, [*held, fresh_store], generation=1, now=moved_at + 600, store_answered=True)
        assert went_on.delete_pods == [], resumed
    # Workers created after the move never joined the old store.
    st.step = 100
    newer = [dataclasses.replace(p, created=moved_at + 1) for p in held]
    after = plan_reconcile(spec, st, [*newer, fresh_store], generation=1, now=moved_at + 600, store_answered=True)
    assert after.delete_pods == []
