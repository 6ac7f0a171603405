"""Pure status logic: what the operator observes of a job's pods, the phase machine, Kubernetes-style
conditions, the printer fields and the bounded decision history. No I/O and no clock: `now` is given.

Phases: Pending (never had minReplicas workers ready) -> Running <-> Adapting (a mode switch or a
membership change is in flight, or workers are not ready; the Adapting condition's reason says
which: SwitchingMode, PodsTerminating, PodsMissing, WorkersUnschedulable, WorkersNotReady) ->
Succeeded | Failed;
Suspended while spec.runPolicy.suspend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sgdjob_operator.api.models import (
    MAX_DECISIONS,
    Condition,
    ControllerState,
    DecisionRecord,
    Phase,
    SGDJobStatus,
)
from sgdjob_operator.k8s.builders import ANNOTATION_EXCLUDED, LABEL_INDEX, LABEL_ROLE, ROLE_RDZV, ROLE_WORKER
from sgdjob_operator.policy.driver import issue, load_state
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand

FINISHED = (Phase.SUCCEEDED, Phase.FAILED)
ACTIVE_POD_PHASES = ("Pending", "Running", "Unknown")
# Pod failures caused by the infrastructure, not by the training: restarted without spending backoffLimit.
INFRA_REASONS = frozenset(
    {
        "Evicted",
        "NodeLost",
        "Preempting",
        "Shutdown",
        "NodeShutdown",
        "Terminated",
        "UnexpectedAdmissionError",
        "OutOfcpu",
        "OutOfmemory",
    }
)
# Conditions always shown; the others appear once they have been true.
ALWAYS_CONDITIONS = ("Created", "Running")
CONDITION_ORDER = ("Created", "Running", "Adapting", "WorkerHung", "Suspended", "Succeeded", "Failed")
NOT_HUNG = (False, "", "")


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PodView:
    """The facts about one of the job's pods that the operator acts on."""

    name: str
    uid: str
    role: str
    index: int | None
    phase: str
    ready: bool
    ip: str | None
    node: str | None
    deleting: bool
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    excluded: tuple[str, ...] = ()  # nodes it was created to stay off
    created: float | None = None  # metadata.creationTimestamp (whole seconds)
    unschedulable: str = ""  # the scheduler's word while it finds no node for the pod (PodScheduled False)
    unschedulable_since: float | None = None  # since when (the condition's lastTransitionTime)

    @property
    def active(self) -> bool:
        return not self.deleting and self.phase in ACTIVE_POD_PHASES

    @classmethod
    def from_obj(cls, pod: dict[str, Any]) -> PodView:
        meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        excluded = str((meta.get("annotations") or {}).get(ANNOTATION_EXCLUDED) or "")
        try:
            index = int(labels[LABEL_INDEX]) if LABEL_INDEX in labels else None
        except ValueError:
            index = None
        conditions = st.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        refused = next(
            (
                c
                for c in conditions
                if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
            ),
            None,
        )
        unschedulable = str(refused.get("message") or "no node fits") if refused is not None else ""
        exit_code: int | None = None
        reason, message = str(st.get("reason") or ""), str(st.get("message") or "")
        for cs in st.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and (exit_code is None or term.get("exitCode", 0) != 0):
                exit_code = int(term.get("exitCode", 0))
                reason = reason or str(term.get("reason") or "")
                message = message or str(term.get("message") or "")
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            role=str(labels.get(LABEL_ROLE, ROLE_WORKER)),
            index=index,
            phase=str(st.get("phase") or "Pending"),
            ready=ready,
            ip=st.get("podIP") or None,
            node=spec.get("nodeName") or None,
            deleting=bool(meta.get("deletionTimestamp")),
            exit_code=exit_code,
            reason=reason,
            message=message[:512],
            excluded=tuple(n for n in excluded.split(",") if n),
            created=parse_time(meta.get("creationTimestamp")),
            unschedulable=unschedulable[:512],
            unschedulable_since=parse_time(refused.get("lastTransitionTime")) if refused is not None else None,
        )


def workers(pods: Iterable[PodView]) -> list[PodView]:
    return sorted(
        (p for p in pods if p.role == ROLE_WORKER and p.index is not None), key=lambda p: (p.index or 0, p.name)
    )


def pod_changed(seen: dict[str, PodView], event_type: str, pod: dict[str, Any]) -> bool:
    """Whether a pod watch event changes what a pass would see (a new or deleted pod, its phase,
    readiness, node, exit status or deletion); records the pod in `seen` (by UID). A scheduler's or
    kubelet's status updates that change none of it would otherwise cost the job a pass each."""
    uid = str((pod.get("metadata") or {}).get("uid") or "")
    if event_type == "DELETED":
        seen.pop(uid, None)
        return True
    view = PodView.from_obj(pod)
    if seen.get(uid) == view:
        return False
    seen[uid] = view
    return True


def rdzv_pods(pods: Iterable[PodView]) -> list[PodView]:
    return [p for p in pods if p.role == ROLE_RDZV]


@dataclass(frozen=True, slots=True)
class Event:
    """A Kubernetes Event to post about the job."""

    type: str  # Normal | Warning
    reason: str
    message: str


def load_status(raw: dict[str, Any] | None) -> SGDJobStatus:
    """The stored status, tolerant of fields a newer or older operator wrote: unknown or invalid
    parts are dropped rather than failing the whole job."""
    raw = dict(raw or {})
    try:
        return SGDJobStatus.model_validate(raw)
    except ValueError:
        known = set(SGDJobStatus.model_fields) | {f.alias for f in SGDJobStatus.model_fields.values() if f.alias}
        kept: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                continue
            try:
                SGDJobStatus.model_validate({key: value})
            except ValueError:
                continue
            kept[key] = value
        return SGDJobStatus.model_validate(kept)


def _compact(value: Any) -> Any:
    """Inside list items, drop null and empty-string members: the v1.20 API server turns an empty
    string inside a merge-patched array into null and then rejects it against the schema."""
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items() if v is not None and v != ""}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


def dump_status(status: SGDJobStatus) -> dict[str, Any]:
    """Status as a merge patch: top-level nulls delete stale members; list items are compacted."""
    raw = status.model_dump(mode="json", by_alias=True, exclude_none=False)
    if raw.get("controller"):
        raw["controller"]["policyState"] = None  # kept in the job's ConfigMap (`k8s.actuator`), never here
    return {
        k: (_compact(v) if isinstance(v, list | dict) and k != "controller" else (None if v == "" else v))
        for k, v in raw.items()
    }


def controller(status: SGDJobStatus) -> ControllerState:
    if status.controller is None:
        status.controller = ControllerState()
    return status.controller


def record_decision(
    status: SGDJobStatus,
    now: float,
    action: str,
    reason: str,
    *,
    mode: str | None = None,
    rank: int | None = None,
    replicas: int | None = None,
    pod: str | None = None,
    hung: bool | None = None,
) -> DecisionRecord:
    """Append to the bounded history (oldest dropped first)."""
    record = DecisionRecord(
        time=rfc3339(now),
        action=action,
        reason=reason[:4096],
        mode=mode,
        rank=rank,
        replicas=replicas,
        step=status.step or None,
        pod=pod,
        hung=hung or None,
    )
    status.decisions = [*status.decisions, record][-MAX_DECISIONS:]
    return record


def new_command(status: SGDJobStatus, now: float, reason: str, *, mode: str) -> dict[str, Any]:
    """Tell the workers to run `mode` (one the spec fixes): the next epoch, merged over the stored
    command by the driver's rule, so nothing set earlier is forgotten."""
    ctl = controller(status)
    state, _ = load_state(None, ctl.command, None)
    after = issue(state, ControlCommand(epoch=0, mode=SyncMode(mode), reason=reason[:4096]))
    ctl.command = after.command_dict()
    ctl.last_change_time = rfc3339(now)
    return ctl.command or {}


def hang_condition(status: SGDJobStatus) -> tuple[bool, str, str]:
    """The WorkerHung condition from the decision history: true from the recovery of a hung worker
    until the job passes the step it hung at (it resumed from an earlier checkpoint), then false
    with reason Recovered. Never true for a job that has not hung (the condition is then not shown)."""
    last = next((d for d in reversed(status.decisions) if d.hung), None)
    if last is None:
        return NOT_HUNG
    who = f"rank {last.rank} (pod {last.pod or 'unknown'})"
    at = last.step or 0
    if status.step > at:
        return False, "Recovered", f"{who} hung at step {at}; the job has since passed that step"
    return True, "WorkerHung", f"{who} made no progress at step {at}; recovering: {last.reason}"


def desired_conditions(
    phase: Phase,
    *,
    created: bool,
    adapting_reason: str,
    message: str,
    suspended_reason: str = "JobSuspended",
    hung: tuple[bool, str, str] = NOT_HUNG,
) -> dict[str, tuple[bool, str, str]]:
    """Condition type -> (true?, reason, message) for a phase; `hung` is `hang_condition`'s."""
    return {
        "Created": (
            created,
            "ObjectsCreated" if created else "Creating",
            "service, secret, config and pods created" if created else "",
        ),
        "Running": (
            phase in (Phase.RUNNING, Phase.ADAPTING),
            "WorkersRunning" if phase in (Phase.RUNNING, Phase.ADAPTING) else phase.value,
            message if phase is Phase.RUNNING else "",
        ),
        "Adapting": (phase is Phase.ADAPTING, adapting_reason or "Stable", message if phase is Phase.ADAPTING else ""),
        "WorkerHung": hung,
        "Suspended": (
            phase is Phase.SUSPENDED,
            suspended_reason if phase is Phase.SUSPENDED else "JobResumed",
            message if phase is Phase.SUSPENDED else "",
        ),
        "Succeeded": (
            phase is Phase.SUCCEEDED,
            (adapting_reason or "WorkersSucceeded") if phase is Phase.SUCCEEDED else "",
            message if phase is Phase.SUCCEEDED else "",
        ),
        "Failed": (
            phase is Phase.FAILED,
            adapting_reason if phase is Phase.FAILED else "",
            message if phase is Phase.FAILED else "",
        ),
    }


def merge_conditions(
    previous: Sequence[Condition], wanted: dict[str, tuple[bool, str, str]], now: float
) -> list[Condition]:
    """Kubernetes conventions: lastTransitionTime changes only when the status flips; optional
    conditions are listed once they have been true."""
    old = {c.type: c for c in previous}
    out: list[Condition] = []
    for ctype in CONDITION_ORDER:
        true, reason, message = wanted[ctype]
        prior = old.get(ctype)
        if not true and prior is None and ctype not in ALWAYS_CONDITIONS:
            continue
        value = "True" if true else "False"
        when = prior.last_transition_time if prior is not None and prior.status == value else rfc3339(now)
        out.append(
            Condition(type=ctype, status=value, reason=reason, message=message[:4096], last_transition_time=when)
        )
    return out


def finish(status: SGDJobStatus, phase: Phase, reason: str, message: str, now: float) -> Event:
    """Move to a terminal phase (idempotent: the first finish wins)."""
    if status.phase not in FINISHED:
        status.phase = phase
        status.completion_time = rfc3339(now)
        status.message = message
        status.conditions = merge_conditions(
            status.conditions,
            desired_conditions(
                phase, created=True, adapting_reason=reason, message=message, hung=hang_condition(status)
            ),
            now,
        )
    return Event("Normal" if phase is Phase.SUCCEEDED else "Warning", reason, message)


def mark_invalid(st: SGDJobStatus, problems: list[str], now: float) -> list[Event]:
    """A spec the schema accepted but the cross-field rules refuse: Failed, naming the fields."""
    message = "invalid spec: " + "; ".join(problems)
    already = st.phase is Phase.FAILED and st.message == message
    event = finish(st, Phase.FAILED, "InvalidSpec", message, now)
    st.message = message
    return [] if already else [event]
