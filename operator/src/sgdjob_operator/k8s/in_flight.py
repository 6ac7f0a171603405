"""What a job waits for: the change still in flight (the Adapting condition's reason and message,
the one-change-at-a-time gate of the policy) and the phase that follows, from observed state only.
Pure functions of the status, the spec and the job's pods."""

from __future__ import annotations

from collections.abc import Sequence

from sgdjob_operator.api.models import Phase, SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.status import PodView, workers


def in_flight_reason(status: SGDJobStatus, spec: SGDJobSpec, pods: Sequence[PodView]) -> tuple[str, str]:
    """(the Adapting condition's reason, a message) for a change still in flight, ('', '') when
    none. The reason tells what the job waits for: a pod not ready whose pod the operator did not
    touch (a node that stopped reporting, an API server restart) reads WorkersNotReady, not a change."""
    if status.mode and status.target_mode and status.mode != status.target_mode:
        return "SwitchingMode", f"switching mode {status.mode} -> {status.target_mode}"
    ws = workers(pods)
    if any(p.deleting for p in ws):
        return "PodsTerminating", "worker pods terminating"
    live = [p for p in ws if p.active]
    if len(live) != spec.replicas:
        return "PodsMissing", f"{len(live)} of {spec.replicas} worker pods exist"
    ready = sum(1 for p in live if p.phase == "Running" and p.ready)
    if ready != spec.replicas:
        # The scheduler's own reason, so `kubectl get`/`describe` say why a worker never starts (no
        # node left that the job may use: every other one excluded, taken or without capacity).
        stuck = [p for p in live if p.unschedulable and p.node is None]
        if stuck:
            first = stuck[0]
            more = f" (and {len(stuck) - 1} more)" if len(stuck) > 1 else ""
            return (
                "WorkersUnschedulable",
                f"{ready} of {spec.replicas} workers ready; {first.name}{more} unschedulable: {first.unschedulable}",
            )
        return "WorkersNotReady", f"{ready} of {spec.replicas} workers ready"
    return "", ""


def refused_grace(spec: SGDJobSpec) -> float:
    """How long the scheduler must refuse a pod before it counts as refused: policy.cooldownSeconds,
    at least an interval."""
    return max(spec.policy.cooldown_seconds, spec.policy.interval_seconds)


def refused_pods(spec: SGDJobSpec, pods: Sequence[PodView], now: float) -> list[PodView]:
    """Worker pods the scheduler has refused (PodScheduled False, Unschedulable) for `refused_grace`:
    capacity the job does not have (the node they need is excluded or lost, or taken), no longer a
    change that is about to land."""
    grace = refused_grace(spec)
    refused = [p for p in workers(pods) if p.active and p.node is None and p.unschedulable]
    return [p for p in refused if now - (p.unschedulable_since or p.created or now) >= grace]


def policy_in_flight(status: SGDJobStatus, spec: SGDJobSpec, pods: Sequence[PodView], now: float) -> str:
    """`in_flight` as the policy's gate reads it: when the only workers not ready are `refused_pods`,
    nothing is in flight for the world the placed workers form (the policy sizes its view from the
    workers' own reports), so the policy goes on deciding for it. Held instead, a job that lost a
    node it could not replace made no change (no rebalance, no switch) until the node came back."""
    reason, why = in_flight_reason(status, spec, pods)
    if reason != "WorkersUnschedulable":
        return why
    refused = {p.name for p in refused_pods(spec, pods, now)}
    waiting = [p for p in workers(pods) if p.active and not (p.phase == "Running" and p.ready)]
    return "" if all(p.name in refused for p in waiting) else why


def in_flight(status: SGDJobStatus, spec: SGDJobSpec, pods: Sequence[PodView]) -> str:
    """Why a change is still in flight ('' when none): the one-change-at-a-time gate and the
    Adapting phase both read this, from observed state only."""
    return in_flight_reason(status, spec, pods)[1]


def phase_for(status: SGDJobStatus, spec: SGDJobSpec, pods: Sequence[PodView]) -> tuple[Phase, str, str]:
    """Phase of a job that is neither finished nor suspended, and the in-flight reason and message."""
    if status.start_time is None:
        return Phase.PENDING, "", ""
    reason, why = in_flight_reason(status, spec, pods)
    return (Phase.ADAPTING, reason, why) if why else (Phase.RUNNING, "", "")
