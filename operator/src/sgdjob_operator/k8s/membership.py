"""Pure rules for which worker pods a job runs and which nodes it keeps off, from status and `now`.

Worker indices: the job runs the indices in `status.controller.workerIndices` (absent: 0..replicas-1).
The policy's rescale removes the pods of the ranks it names, so the indices left need not be a range;
a count that differs from spec.replicas (a `kubectl scale`, an operator restart between two writes)
is mended by dropping the highest indices or adding the lowest free ones, so every pass computes the
same set from the same object and a restarted operator neither duplicates nor picks another pod.

A growth the scheduler cannot place: the policy grows a job it shrank back to the user's replicas once
the fleet is healthy, but the node it left may be the only one there is (still excluded), or another
job may have taken the capacity. A worker pod of a job the policy sized that the scheduler has
refused for a cooldown is given back (`unplaced_growth`): the job runs the pods it has, and the
policy grows it again only after `growth_held_until` (the first exclusion's end, else
GROWTH_RETRY_SECONDS), or sooner when an exclusion ends or a lost node returns. Kept waiting, the
pod held every later change of the policy (a change in flight) until the exclusion ended, an hour
at the default excludeNodeSeconds.

Node exclusions: a node the policy took a worker off because the node was slow is excluded until
`policy.excludeNodeSeconds` after the decision (0: for the job's lifetime). An exclusion without an
end (stored by an older operator, or while excludeNodeSeconds was 0) gets one from its start and the
current excludeNodeSeconds; one without a start is dated at the first pass that reads it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sgdjob_operator.api.models import Action, ControllerState, ExcludedNode, SGDJobSpec
from sgdjob_operator.k8s.in_flight import refused_grace, refused_pods
from sgdjob_operator.k8s.status import PodView, parse_time, rfc3339

MAX_EXCLUDED = 256
# Seconds before the policy grows again after a given-back growth when no exclusion's end is known
# (the scheduler's refusal was for capacity, or nodes are excluded for the job's lifetime).
GROWTH_RETRY_SECONDS = 600.0


def normalise(indices: Iterable[int], replicas: int) -> list[int]:
    """`replicas` indices: those given, less the highest, or plus the lowest free ones."""
    kept = sorted(set(indices))[:replicas]
    free = (i for i in range(replicas + len(kept)) if i not in kept)
    return sorted([*kept, *(next(free) for _ in range(replicas - len(kept)))])


def wanted_indices(ctl: ControllerState, replicas: int) -> list[int]:
    """The worker indices the job runs at `replicas` pods."""
    stored = ctl.worker_indices if ctl.worker_indices is not None else range(replicas)
    return normalise(stored, replicas)


def store_indices(ctl: ControllerState, indices: Sequence[int]) -> None:
    """Keep the set in status only when it is not the plain range (the common case stays compact)."""
    ordered = sorted(indices)
    ctl.worker_indices = None if ordered == list(range(len(ordered))) else ordered


def rescaled_indices(current: Sequence[int], replicas: int, remove: Iterable[int]) -> list[int]:
    """The indices after a rescale to `replicas` that removes `remove` first; new pods take the
    lowest indices that are neither kept nor just removed (a removed pod's name is still taken)."""
    gone = set(remove)
    kept = [i for i in sorted(current) if i not in gone][:replicas]
    free = (i for i in range(replicas + len(current) + len(gone)) if i not in kept and i not in gone)
    return sorted([*kept, *(next(free) for _ in range(replicas - len(kept)))])


def goal_replicas(spec: SGDJobSpec, ctl: ControllerState) -> int:
    """The replicas the job should run when healthy: the user's, kept when the policy shrank the
    job; once spec.replicas differs from what the policy set, a person scaled it and that wins."""
    if ctl.goal_replicas is None or ctl.scaled_replicas != spec.replicas:
        return spec.replicas
    return max(spec.min_workers, min(spec.max_workers, ctl.goal_replicas))


def policy_goal(spec: SGDJobSpec, ctl: ControllerState, now: float, refused: int = 0) -> int:
    """The replicas the policy may grow the job to now: `goal_replicas`, but no more than it runs
    while a given-back growth holds (`growth_held`), nor than the pods the scheduler placed while
    `refused` of them wait for a node (growing then would only ask for more of what it lacks)."""
    goal = goal_replicas(spec, ctl)
    if refused:
        goal = min(goal, spec.replicas - refused)
    return min(goal, spec.replicas) if growth_held(ctl, now) else goal


def growth_held(ctl: ControllerState, now: float) -> bool:
    until = parse_time(ctl.growth_held_until)
    return until is not None and now < until


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Run `replicas` workers: the pods the scheduler has not placed (`pods`, `indices`) go."""

    replicas: int
    pods: tuple[str, ...]
    indices: tuple[int, ...]
    reason: str


def unplaced_growth(spec: SGDJobSpec, ctl: ControllerState, pods: Sequence[PodView], now: float) -> GiveBack | None:
    """The worker pods to give back: those the scheduler has refused (PodScheduled False,
    Unschedulable) for policy.cooldownSeconds (at least an interval), in a job whose replicas the
    policy set (rescale allowed, spec.replicas as the policy left it: a size a person chose is
    theirs to wait for), when the pods it keeps are still at least minReplicas. None otherwise."""
    if Action.RESCALE not in spec.policy.allowed_actions or ctl.scaled_replicas != spec.replicas:
        return None
    grace = refused_grace(spec)
    stuck = [p for p in refused_pods(spec, pods, now) if p.index is not None]
    keep = spec.replicas - len(stuck)
    if not stuck or keep < spec.min_workers:
        return None
    names = ", ".join(p.name for p in stuck)
    reason = (
        f"{names} unschedulable for {grace:g} s or more ({stuck[0].unschedulable}); running the {keep} placed workers"
    )
    return GiveBack(keep, tuple(p.name for p in stuck), tuple(p.index for p in stuck if p.index is not None), reason)


def hold_growth(ctl: ControllerState, now: float, least: float) -> str:
    """No growth by the policy until the first exclusion ends (the node the growth could not have),
    else for GROWTH_RETRY_SECONDS; at least `least` seconds. Returns the end (RFC 3339)."""
    ends = [t for e in ctl.excluded_nodes if (t := parse_time(e.until)) is not None]
    until = max(now + least, min(ends) if ends else now + GROWTH_RETRY_SECONDS)
    ctl.growth_held_until = rfc3339(until)
    return ctl.growth_held_until


def record_scale(spec: SGDJobSpec, ctl: ControllerState, replicas: int) -> None:
    """Remember the user's replicas across the policy's own scaling."""
    ctl.goal_replicas = goal_replicas(spec, ctl)
    ctl.scaled_replicas = replicas


def exclude(
    ctl: ControllerState, node: str, now: float, seconds: float, reason: str, *, lost: bool = False
) -> ExcludedNode:
    """Keep the job off `node` from `now` (renewed when already excluded), oldest dropped past the bound.
    `lost`: the node was lost, and the exclusion ends when it is Ready again (`readmit`)."""
    entry = ExcludedNode(
        node=node,
        since=rfc3339(now),
        until=rfc3339(now + seconds) if seconds > 0 else None,
        reason=reason[:512],
        lost=lost,
    )
    others = [e for e in ctl.excluded_nodes if e.node != node]
    ctl.excluded_nodes = [*others[-(MAX_EXCLUDED - 1) :], entry]
    return entry


def expire(ctl: ControllerState, now: float, seconds: float) -> list[ExcludedNode]:
    """Drop the exclusions whose time is up; date the undated ones. Returns those dropped."""
    kept: list[ExcludedNode] = []
    gone: list[ExcludedNode] = []
    for e in ctl.excluded_nodes:
        if e.since is None:
            e = e.model_copy(update={"since": rfc3339(now)})
        if e.until is None and seconds > 0:
            e = e.model_copy(update={"until": rfc3339((parse_time(e.since) or now) + seconds)})
        until = parse_time(e.until)
        (gone if until is not None and now >= until else kept).append(e)
    ctl.excluded_nodes = kept
    if gone:
        ctl.growth_held_until = None  # a node the job may use again: growing may succeed now
    return gone


def readmit(ctl: ControllerState, ready: Collection[str]) -> list[ExcludedNode]:
    """Drop the exclusions of lost nodes that are Ready again (`ready`); returns those dropped. A node
    excluded for being slow stays excluded for its time: being Ready says nothing of its speed."""
    back = [e for e in ctl.excluded_nodes if e.lost and e.node in ready]
    ctl.excluded_nodes = [e for e in ctl.excluded_nodes if e not in back]
    if back:
        ctl.growth_held_until = None
    return back


def lost_exclusions(ctl: ControllerState) -> list[str]:
    """The nodes excluded because they were lost: whose readiness the operator watches."""
    return [e.node for e in ctl.excluded_nodes if e.lost]


def excluded_names(ctl: ControllerState) -> list[str]:
    return [e.node for e in ctl.excluded_nodes]
