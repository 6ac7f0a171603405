"""Worker pods the scheduler cannot place. A growth is given back: the policy shrank a job off a slow
node, grew it back once the fleet was healthy, and the only node left for the new pod is the excluded
one; the job then runs its placed workers, the pending pod goes, and the policy grows again only
once an exclusion ends (before: the pod held every later change of the policy for
excludeNodeSeconds). A pod a person's size asks for waits, but the policy goes on deciding for the
world the placed workers form (before: a lost node's unplaceable replacement froze the policy)."""

from __future__ import annotations

import dataclasses

from sgdjob_operator.api.models import SGDJobStatus
from sgdjob_operator.k8s.actuator import apply_step, driver_state, give_back, store
from sgdjob_operator.k8s.in_flight import in_flight, policy_in_flight
from sgdjob_operator.k8s.membership import goal_replicas, policy_goal, unplaced_growth
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.k8s.status import PodView, controller, rfc3339
from sgdjob_operator.policy import Rescale, job_view
from sgdjob_operator.policy.driver import Observed, Step, action_for
from tests.unit.test_k8s_membership import rescale_decision, restarted
from tests.unit.test_status import T0, _sample, _spec, pod, rdzv, running

POLICY = {"allowedActions": ["rescale"], "cooldownSeconds": 60}
WHY = "0/4 nodes are available: 3 node(s) had untolerated taint, 1 node(s) didn't match Pod's node affinity"


def grown_back() -> SGDJobStatus:
    """Shrunk 4 -> 3 off node n1 at T0 (excluded until T0 + 3600), then grown back to 4 at T0 + 100."""
    st = running()
    rescale_decision(st, 3, (1,), [pod(i, node=f"n{i}") for i in range(4)] + [rdzv()])
    spec3 = _spec(replicas=3, policy=POLICY)
    state, _ = driver_state(st)
    decision = Rescale(4, "grow to 4 nodes")
    state, action = action_for(state, decision, Observed(tuple(_sample(r) for r in range(3))), spec3, job_view(spec3))
    store(st, state)
    out = apply_step(st, Step(state, decision, action), T0 + 100, spec3, [])
    assert out.scale_to == 4 and controller(st).scaled_replicas == 4
    return st


def refused(since: float) -> PodView:
    return dataclasses.replace(pod(1, "Pending", ready=False), unschedulable=WHY, unschedulable_since=since)


def test_a_growth_the_scheduler_refuses_for_a_cooldown_is_given_back() -> None:
    st, spec4 = grown_back(), _spec(replicas=4, policy=POLICY)
    ctl = controller(st)
    pods = [pod(0, node="n0"), refused(T0 + 101), pod(2, node="n2"), pod(3, node="n3"), rdzv()]
    assert unplaced_growth(spec4, ctl, pods, T0 + 150) is None  # refused for 49 s: the scheduler may yet place it
    back = unplaced_growth(spec4, ctl, pods, T0 + 161)
    assert back is not None and (back.replicas, back.pods, back.indices) == (3, ("j-worker-1",), (1,))
    assert WHY in back.reason and "running the 3 placed workers" in back.reason

    out = give_back(st, spec4, back, T0 + 161)
    assert out.scale_to == 3
    assert ctl.worker_indices == [0, 2, 3] and (ctl.goal_replicas, ctl.scaled_replicas) == (4, 3)
    assert ctl.restart_from is None, "no world changed: no restart to measure"
    assert ctl.growth_held_until == rfc3339(T0 + 3600), "held until node n1's exclusion ends"
    (event,) = out.events
    assert event.type == "Warning" and event.reason == "GrowthUnschedulable"
    assert "rescaling 4 -> 3 workers (giving back j-worker-1)" in event.message and WHY in event.message
    assert st.decisions[-1].replicas == 3 and st.decisions[-1].reason.startswith("growth given back")
    assert driver_state(st)[0].policy.last_change == T0 + 100, "the cooldown runs on from the growth"

    # The pass scales to 3: the pending pod goes, nothing is created, and the policy may not grow.
    spec3 = _spec(replicas=3, policy=POLICY)
    plan = plan_reconcile(spec3, restarted(st), pods, generation=3, now=T0 + 162)
    assert plan.delete_pods == [("j-worker-1", "scaled down to 3 replicas")] and plan.create_workers == []
    assert goal_replicas(spec3, controller(plan.status)) == 4
    assert policy_goal(spec3, controller(plan.status), T0 + 162) == 3
    assert policy_goal(spec3, controller(plan.status), T0 + 3599) == 3

    # Node n1's exclusion ends: the hold goes with it, and the policy may grow back to 4 again.
    placed = [pod(0, node="n0"), pod(2, node="n2"), pod(3, node="n3"), rdzv()]
    later = plan_reconcile(spec3, restarted(plan.status), placed, generation=3, now=T0 + 3600)
    assert "NodeExclusionExpired" in [e.reason for e in later.events]
    assert controller(later.status).growth_held_until is None
    assert policy_goal(spec3, controller(later.status), T0 + 3600) == 4


def test_only_a_size_the_policy_set_is_given_back() -> None:
    st = grown_back()
    ctl = controller(st)
    pods = [pod(0, node="n0"), refused(T0 + 101), pod(2, node="n2"), pod(3, node="n3"), rdzv()]
    late = T0 + 1000
    assert unplaced_growth(_spec(replicas=4, policy=POLICY), ctl, pods, late) is not None
    # A person scaled the job to 5 since: their pods are theirs to wait for.
    five = [*pods, dataclasses.replace(refused(T0 + 500), name="j-worker-4", index=4)]
    assert unplaced_growth(_spec(replicas=5, maxReplicas=5, policy=POLICY), ctl, five, late) is None
    # Rescale no longer allowed, or the placed workers below minReplicas: the job waits as before.
    no_rescale = {**POLICY, "allowedActions": ["rebalance"]}
    assert unplaced_growth(_spec(replicas=4, policy=no_rescale), ctl, pods, late) is None
    assert unplaced_growth(_spec(replicas=4, minReplicas=4, maxReplicas=5, policy=POLICY), ctl, pods, late) is None
    # A pod the scheduler has not refused (just created, or placed and starting) is not given back.
    starting = [pod(0, node="n0"), pod(1, "Pending", ready=False), pod(2, node="n2"), pod(3, node="n3"), rdzv()]
    assert unplaced_growth(_spec(replicas=4, policy=POLICY), ctl, starting, late) is None


def test_without_an_exclusion_to_wait_for_growth_is_retried_after_ten_minutes() -> None:
    st = grown_back()
    ctl = controller(st)
    ctl.excluded_nodes = []  # refused for capacity, say another job took the node
    pods = [pod(0, node="n0"), refused(T0 + 101), pod(2, node="n2"), pod(3, node="n3"), rdzv()]
    spec4 = _spec(replicas=4, policy=POLICY)
    back = unplaced_growth(spec4, ctl, pods, T0 + 200)
    assert back is not None
    give_back(st, spec4, back, T0 + 200)
    assert ctl.growth_held_until == rfc3339(T0 + 800)
    spec3 = _spec(replicas=3, policy=POLICY)
    assert policy_goal(spec3, ctl, T0 + 799) == 3 and policy_goal(spec3, ctl, T0 + 800) == 4


def test_the_policy_goes_on_for_the_placed_world_while_a_replacement_waits_for_a_node() -> None:
    """A job a person sized (3 workers, minReplicas 2) lost a node; its replacement finds none."""
    spec = _spec(replicas=3, minReplicas=2, policy={"allowedActions": ["rebalance", "rescale"], "cooldownSeconds": 60})
    st = running()
    pods = [pod(0, node="n0"), pod(1, node="n1"), dataclasses.replace(refused(T0 + 100), name="j-worker-2", index=2)]
    assert "unschedulable" in in_flight(st, spec, pods)  # what status shows: the job waits for a worker
    assert policy_in_flight(st, spec, pods, T0 + 159) == in_flight(st, spec, pods)  # refused for 59 s: may land
    assert policy_in_flight(st, spec, pods, T0 + 160) == ""  # capacity it lacks: the policy decides for two
    assert unplaced_growth(spec, controller(st), pods, T0 + 160) is None, "a person's size is not given back"
    # Its goal is what is placed: no growth proposed towards the pod that waits.
    assert policy_goal(spec, controller(st), T0 + 160, refused=1) == 2
    # A worker still starting (placed, not ready) is a change landing: the policy waits for it.
    starting = [pod(0, node="n0"), pod(1, "Pending", ready=False, node="n1"), pods[2]]
    assert policy_in_flight(st, spec, starting, T0 + 160) != ""
