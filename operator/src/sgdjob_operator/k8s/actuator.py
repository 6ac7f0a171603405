"""The operator's side of the decision driver: the driver's state lives in status (the policy's
state and the merged control command in `status.controller`, the workers' mode in `status.mode`),
so a restarted operator resumes from the object, never from memory; and `StatusActuator` carries
an action out by recording it in status (decision history, target mode, excluded nodes, command)
and in the `Outcome` the reconciliation pass then acts on (Events, scale, pod to delete)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgdjob_operator.api.models import SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.observe import Observation
from sgdjob_operator.k8s.status import Event, controller, record_decision, rfc3339
from sgdjob_operator.policy.decisions import SwitchMode
from sgdjob_operator.policy.driver import (
    DriverState,
    Observed,
    Push,
    Replace,
    Scale,
    Step,
    act,
    drive,
    first_call_wait,
    load_state,
)

MAX_EXCLUDED = 256


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


def store(st: SGDJobStatus, state: DriverState) -> None:
    ctl = controller(st)
    ctl.policy_state = state.policy_json()
    ctl.command = state.command_dict()


def evaluate_job(spec: SGDJobSpec, st: SGDJobStatus, obs: Observation, now: float, busy: str) -> tuple[Step, str]:
    """The driver's step for this scrape (`busy`: why a change is in flight, from the pods), with
    its state already kept in `st`, and any problem loading or evaluating to report."""
    state, problem = driver_state(st)
    step = drive(state, Observed(obs.samples, applied_epoch=obs.control_epoch, in_flight=busy), spec, now)
    store(st, step.state)
    return step, "; ".join(p for p in (problem, step.problem) if p)


def first_pass_wait(spec: SGDJobSpec, st: SGDJobStatus, obs: Observation) -> float:
    """Seconds before this world's first evaluation is worth making (`policy.driver.first_call_wait`)."""
    state, _ = driver_state(st)
    return first_call_wait(state, obs.samples, spec.policy.interval_seconds)


def apply_step(st: SGDJobStatus, step: Step, now: float) -> Outcome:
    """Record the step's action in status and say what else the pass must do."""
    out = Outcome(held=step.held)
    if step.action is not None:
        act(step.action, StatusActuator(st, now, out))
        out.applied = step.action.decision.action
    return out


@dataclass(slots=True)
class StatusActuator:
    """Carries actions out on the job's status and the pass's `Outcome`."""

    st: SGDJobStatus
    now: float
    out: Outcome

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
        sizes = {str(r): int(b) for r, b in d.batch_sizes.items()}
        record_decision(self.st, self.now, d.action, d.reason)
        self.out.events.append(Event("Normal", "Rebalance", f"per-rank batch sizes {sizes}: {d.reason}"))

    def replace(self, action: Replace) -> None:
        ctl, node = controller(self.st), action.exclude_node
        if node:
            ctl.excluded_nodes = [*[n for n in ctl.excluded_nodes if n != node][-(MAX_EXCLUDED - 1) :], node]
        elif action.pod:
            self.out.delete_pod = action.pod
        record = record_decision(self.st, self.now, action.decision.action, action.decision.reason, rank=action.rank)
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
        self.out.scale_to = action.replicas
        reason = action.decision.reason
        record = record_decision(self.st, self.now, action.decision.action, reason, replicas=action.replicas)
        message = f"rescaling {action.current} -> {action.replicas} workers: {reason}"
        self.out.events.append(Event("Normal", "Rescale", message))
        controller(self.st).last_change_time = record.time
