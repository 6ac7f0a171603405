"""The operator's side of the decision driver: the driver's state lives in the object, so a
restarted operator resumes from it, never from memory (the merged control command in
`status.controller`, the workers' mode in `status.mode`, the policy core's state in the job's
`<job>-policy-state` ConfigMap); and `StatusActuator` carries an action out by recording it in
status (decision history, target mode, excluded nodes, command) and in the `Outcome` the
reconciliation pass then acts on (Events, scale, pod to delete).

The policy's state (per-rank counters, streaks, the learned noise) is the operator's bookkeeping,
not a story for a person, and `kubectl describe sgdjob` prints all of status: so it lives in the
ConfigMap. During a pass it is held in `status.controller.policyState` in memory, where the driver
reads and leaves it, and `take_policy_state` removes it before status is written. An older
operator kept it in status: a pass that finds it there copies it into the ConfigMap (unless one
exists, which is newer) and then writes status without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.api.models import ControllerState, SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.builders import POLICY_STATE_KEY
from sgdjob_operator.k8s.membership import (
    GiveBack,
    exclude,
    hold_growth,
    policy_goal,
    record_scale,
    rescaled_indices,
    store_indices,
    wanted_indices,
)
from sgdjob_operator.k8s.observe import Observation
from sgdjob_operator.k8s.restart_cost import job_shrink_estimate, measure_restart, restart_began, restart_estimate
from sgdjob_operator.k8s.status import Event, PodView, controller, record_decision, rfc3339
from sgdjob_operator.policy.decisions import SwitchMode, per_rank_text
from sgdjob_operator.policy.driver import (
    DriverState,
    Observed,
    PlatformCosts,
    Push,
    Replace,
    Scale,
    Step,
    act,
    drive,
    first_call_wait,
    load_state,
    restarted,
)


@dataclass(slots=True)
class Outcome:
    """What one evaluation asks the pass to do beyond writing status."""

    events: list[Event] = field(default_factory=list)
    scale_to: int | None = None
    delete_pod: str | None = None
    config_changed: bool = False
    applied: str | None = None  # action applied, for metrics
    held: str | None = None  # action the policy held back because a change is in flight
    problem: str = ""  # why the policy's state or decision was dropped ('' when nothing was)


def driver_state(st: SGDJobStatus) -> tuple[DriverState, str]:
    ctl = controller(st)
    return load_state(ctl.policy_state, ctl.command, st.mode)


def stored_policy_state(config_map: dict[str, Any] | None) -> str | None:
    """The policy's state in its ConfigMap; None when there is none yet."""
    text = ((config_map or {}).get("data") or {}).get(POLICY_STATE_KEY)
    return str(text) if text else None


def take_policy_state(st: SGDJobStatus) -> str | None:
    """The policy's state held in `st.controller` (an older operator's, as read from the object,
    or what this pass's evaluation left there), removed: status is written without it."""
    ctl = st.controller
    if ctl is None:
        return None
    text, ctl.policy_state = ctl.policy_state, None
    return text or None


def store(st: SGDJobStatus, state: DriverState) -> None:
    ctl = controller(st)
    ctl.policy_state = state.policy_json()
    ctl.command = state.command_dict()


def evaluate_job(
    spec: SGDJobSpec,
    st: SGDJobStatus,
    obs: Observation,
    now: float,
    busy: str,
    created: float | None = None,
    refused: int = 0,
) -> tuple[Step, str]:
    """The driver's step for this scrape (`busy`: why a change is in flight, from the pods), with
    its state already kept in `st`, and any problem loading or evaluating to report. `created`: the
    job's creation time, from which its first start is measured (restart_cost); `refused`: worker
    pods the scheduler has refused for a while (`in_flight.refused_pods`)."""
    state, problem = driver_state(st)
    ctl = controller(st)
    goal = policy_goal(spec, ctl, now, refused)
    observed = Observed(
        obs.samples, applied_epoch=obs.control_epoch, in_flight=busy, goal_replicas=goal, step=st.step or None
    )
    # The first start is measured from the job's creation only while no worker has restarted: a world
    # that a failure restarted began long after it, and that span is no restart's cost.
    measure_restart(ctl, obs.samples, created if st.restarts == 0 else None)
    costs = PlatformCosts(restart_seconds=restart_estimate(ctl), shrink_seconds=job_shrink_estimate(ctl, obs.samples))
    step = drive(state, observed, spec, now, costs)
    store(st, step.state)
    return step, "; ".join(p for p in (problem, step.problem) if p)


def first_pass_wait(spec: SGDJobSpec, st: SGDJobStatus, obs: Observation) -> float:
    """Seconds before this world's first evaluation is worth making (`policy.driver.first_call_wait`)."""
    state, _ = driver_state(st)
    return first_call_wait(state, obs.samples, spec.policy.interval_seconds)


def apply_step(st: SGDJobStatus, step: Step, now: float, spec: SGDJobSpec, pods: Sequence[PodView] = ()) -> Outcome:
    """Record the step's action in status and say what else the pass must do (`pods`: the job's
    pods, to find the index of a pod a rescale removes)."""
    out = Outcome(held=step.held)
    if step.action is not None:
        indices = {p.name: p.index for p in pods if p.index is not None}
        act(step.action, StatusActuator(st, now, out, spec, indices))
        out.applied = step.action.decision.action
    return out


def give_back(st: SGDJobStatus, spec: SGDJobSpec, back: GiveBack, now: float) -> Outcome:
    """Record in `st` that the job runs only its placed workers (`membership.unplaced_growth`) and
    grows no more for a while; the pass then scales the job to `back.replicas`. The running world
    is not changed (the pods that go never joined it), so no restart is measured and the cooldown
    runs on from the growth; the policy's measurements start over, as the growth had told it of a
    larger world."""
    ctl = controller(st)
    out = Outcome(scale_to=back.replicas, applied="rescale")
    rescale_indices(ctl, spec, back.replicas, back.indices)
    ctl.restart_from, ctl.restart_shrinks = None, None
    until = hold_growth(ctl, now, spec.policy.interval_seconds)
    ranks_anew(st, spec, now, back.replicas, keep_clock=True)
    record_decision(st, now, "rescale", f"growth given back: {back.reason}", replicas=back.replicas)
    message = (
        f"rescaling {spec.replicas} -> {back.replicas} workers (giving back {', '.join(back.pods)}): {back.reason}; "
        f"no growth until {until}"
    )
    out.events.append(Event("Warning", "GrowthUnschedulable", message))
    return out


@dataclass(slots=True)
class StatusActuator:
    """Carries actions out on the job's status and the pass's `Outcome`."""

    st: SGDJobStatus
    now: float
    out: Outcome
    spec: SGDJobSpec
    indices: Mapping[str, int] = field(default_factory=dict)  # worker pod name -> index

    def push(self, action: Push) -> None:
        # The command is in status already (the driver's state): the pass sends it until rank 0 has it.
        d, ctl = action.decision, controller(self.st)
        ctl.last_change_time = rfc3339(self.now)
        if isinstance(d, SwitchMode):
            self.st.target_mode = d.mode
            record_decision(self.st, self.now, d.action, d.reason, mode=d.mode)
            self.out.events.append(Event("Normal", "SwitchMode", f"switching to {d.mode}: {d.reason}"))
            self.out.config_changed = True
            return
        record_decision(self.st, self.now, d.action, d.reason)
        sizes = per_rank_text(d.batch_sizes)
        self.out.events.append(Event("Normal", "Rebalance", f"per-rank batch sizes {sizes}: {d.reason}"))

    def replace(self, action: Replace) -> None:
        ctl, node = controller(self.st), action.exclude_node
        if node:
            exclude(ctl, node, self.now, self.spec.policy.exclude_node_seconds, f"rank {action.rank} slow on it")
        elif action.pod:
            self.out.delete_pod = action.pod
        restart_began(ctl, self.now)
        ranks_anew(self.st, self.spec, self.now, len(wanted_indices(ctl, self.spec.replicas)))
        d = action.decision
        record = record_decision(self.st, self.now, d.action, d.reason, rank=action.rank, pod=action.pod, hung=d.hung)
        where = f"; node {node} excluded for this job" if node else ""
        message = f"replacing rank {action.rank} (pod {action.pod or 'unknown'}){where}: {action.decision.reason}"
        # A hang is a fault a person may want to look into (the node, the data); a slow worker is routine.
        event = (
            Event("Warning", "WorkerHung", message)
            if action.decision.hung
            else Event("Normal", "ReplaceWorker", message)
        )
        self.out.events.append(event)
        ctl.last_change_time = record.time

    def scale(self, action: Scale) -> None:
        """The pods of the ranks the policy names go (their indices leave the wanted set, so the
        plan deletes exactly them, in this pass or after a restart); new pods take free indices."""
        ctl, reason = controller(self.st), action.decision.reason
        self.out.scale_to = action.replicas
        removed = [self.indices[p] for p in action.remove_pods if p in self.indices]
        current = rescale_indices(ctl, self.spec, action.replicas, removed)
        restart_began(ctl, self.now, shrink=action.replicas < current)
        ranks_anew(self.st, self.spec, self.now, action.replicas)
        if action.exclude_node:
            why = f"ranks {list(action.remove_ranks)} slow on it; removed by a rescale"
            exclude(ctl, action.exclude_node, self.now, self.spec.policy.exclude_node_seconds, why)
        record = record_decision(self.st, self.now, action.decision.action, reason, replicas=action.replicas)
        what = f"removing {', '.join(action.remove_pods)}" if action.remove_pods else ""
        if action.replicas > action.current:
            what = f"growing back towards {ctl.goal_replicas} replicas"
        if action.exclude_node:
            what += f"; node {action.exclude_node} excluded for this job"
        message = f"rescaling {action.current} -> {action.replicas} workers{f' ({what})' if what else ''}: {reason}"
        self.out.events.append(Event("Normal", "Rescale", message))
        ctl.last_change_time = record.time


def rescale_indices(ctl: ControllerState, spec: SGDJobSpec, replicas: int, removed: Sequence[int]) -> int:
    """The wanted worker indices after a rescale to `replicas` without `removed`, recorded with the
    scale itself; returns how many were wanted before."""
    current = wanted_indices(ctl, spec.replicas)
    store_indices(ctl, rescaled_indices(current, replicas, removed))
    record_scale(spec, ctl, replicas)
    return len(current)


def ranks_anew(st: SGDJobStatus, spec: SGDJobSpec, now: float, replicas: int, *, keep_clock: bool = False) -> None:
    """A membership change hands the ranks out anew: per-rank batch sizes and groups, which name
    the old world's ranks, are dropped, the new world is told the job's batch on every rank, and
    the policy starts over from the change (`driver.restarted`, as the local runner does). Kept,
    a rescale from 3 to 2 ran the survivors on their shares of the old world's split until a later
    pass restored plain sync (measured on real nodes). `keep_clock`: the change restarted nothing
    (a growth given back), so the cooldown runs on from the last change."""
    state, _ = driver_state(st)
    fresh, _ = restarted(state, now, replicas * spec.nproc_per_node, spec.training.batch_size, None)
    if keep_clock:
        was = state.policy
        kept = dataclasses.replace(fresh.policy, last_change=was.last_change, last_pause=was.last_pause)
        fresh = dataclasses.replace(fresh, policy=kept)
    store(st, fresh)
