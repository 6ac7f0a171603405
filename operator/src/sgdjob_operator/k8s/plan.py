"""Pure reconciliation planning: from the spec, the stored status and the observed pods to the pods to
create and delete, the new status and the Events. The kopf shell only carries the plan out.

Level-based: nothing here remembers a previous call. Failed pods already counted against the
backoff budget are remembered by UID in status, so a restart of the operator (or a re-run of a tick
after a crash between two writes) never counts one failure twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sgdjob_operator.api.models import CleanPodPolicy, JobMode, Phase, SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.failures import classify
from sgdjob_operator.k8s.in_flight import phase_for
from sgdjob_operator.k8s.membership import (
    exclude,
    excluded_names,
    expire,
    readmit,
    store_indices,
    wanted_indices,
)
from sgdjob_operator.k8s.nodeloss import lost_pods
from sgdjob_operator.k8s.status import (
    FINISHED,
    Event,
    PodView,
    controller,
    desired_conditions,
    finish,
    hang_condition,
    merge_conditions,
    new_command,
    parse_time,
    rdzv_pods,
    record_decision,
    rfc3339,
    workers,
)
from sgdjob_operator.k8s.storeloss import (
    closed_store,
    follow_store,
    moved,
    store_failure_cause,
    store_to_probe,
    stranded_workers,
)
from sgdjob_trainer.wire.launch_contract import COMMAND_MODE_NOTE
from sgdjob_trainer.wire.worker_status import TARGET_REACHED, parse_termination

MAX_COUNTED = 256
QUEUED = "Queued"  # the Suspended condition's reason while Kueue has not admitted the job


@dataclass(slots=True)
class Plan:
    status: SGDJobStatus
    create_workers: list[int] = field(default_factory=list)
    create_rdzv: bool = False
    delete_pods: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    force_delete: set[str] = field(default_factory=set)  # of delete_pods: grace 0 (their node is lost)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False


def _cleanup(plan: Plan, spec: SGDJobSpec, pods: Sequence[PodView]) -> None:
    policy = spec.run_policy.clean_pod_policy
    for pod in pods:
        if pod.deleting or policy is CleanPodPolicy.NONE:
            continue
        if policy is CleanPodPolicy.ALL or pod.phase in ("Pending", "Running", "Unknown"):
            plan.delete_pods.append((pod.name, f"job finished (cleanPodPolicy {policy.value})"))


def _follow_spec_mode(status: SGDJobStatus, spec: SGDJobSpec, now: float, events: list[Event]) -> None:
    """A fixed spec.mode is the user's decision; auto starts from the initial mode and lets the policy move it."""
    if status.target_mode is None:
        status.target_mode = spec.initial_mode.value
        return
    if spec.mode is not JobMode.AUTO and status.target_mode != spec.mode.value:
        reason = f"spec.mode set to {spec.mode.value}"
        status.target_mode = spec.mode.value
        new_command(status, now, reason, mode=spec.mode.value)
        record_decision(status, now, "switchMode", reason, mode=spec.mode.value)
        events.append(Event("Normal", "SwitchMode", reason))


def _count_failures(
    plan: Plan, spec: SGDJobSpec, pods: Sequence[PodView], lost: Mapping[str, tuple[float, str]], now: float
) -> None:
    """Failed workers are recreated; those `failures.classify` blames on the job spend backoffLimit."""
    st = plan.status
    ctl = controller(st)
    for pod in workers(pods):
        if pod.phase != "Failed" or pod.name in plan.force_delete:
            continue
        if pod.uid not in ctl.counted_failures:
            ctl.counted_failures = [*ctl.counted_failures, pod.uid][-MAX_COUNTED:]
            verdict = classify(pod, pods, lost, store_failure_cause(ctl, pod))
            if verdict.counted:
                st.restarts += 1
            budget = (
                f"restart {st.restarts} of backoffLimit {spec.run_policy.backoff_limit}"
                if verdict.counted
                else "not counted: infrastructure"
            )
            plan.events.append(Event("Warning", "WorkerFailed", f"{verdict.cause}; {budget}"))
            if st.restarts > spec.run_policy.backoff_limit:
                plan.events.append(
                    finish(
                        st,
                        Phase.FAILED,
                        "BackoffLimitExceeded",
                        f"{st.restarts} worker failures exceed backoffLimit {spec.run_policy.backoff_limit}; "
                        f"last: {verdict.cause}",
                        now,
                    )
                )
                return
        if not pod.deleting:
            plan.delete_pods.append((pod.name, "failed; recreated"))


def _watch_store(plan: Plan, spec: SGDJobSpec, pods: Sequence[PodView], answered: bool | None, now: float) -> None:
    """A store silent for storeLostGraceSeconds while the job stalls: force-deleted, recreated elsewhere."""
    store = store_to_probe(pods)
    grace = spec.run_policy.store_lost_grace_seconds
    rehome = follow_store(controller(plan.status), store, answered, step=plan.status.step, now=now, grace_s=grace)
    if rehome is None:
        return
    plan.delete_pods.append((rehome.pod, "store not answering; re-homed"))
    plan.force_delete.add(rehome.pod)
    avoid = f", off node {rehome.node}" if rehome.node else ""
    plan.events.append(Event("Warning", "StoreLost", f"{rehome.why}; recreating it{avoid}"))


def _reopen_closed(plan: Plan, pods: Sequence[PodView], now: float) -> None:
    """A store whose rendezvous its agents closed: deleted (gracefully), recreated with a fresh one.
    After `_count_failures`: the failures seen in this pass are judged against the store they had."""
    rehome = closed_store(controller(plan.status), pods, step=plan.status.step, now=now)
    if rehome is None or rehome.pod in {name for name, _ in plan.delete_pods}:
        return
    plan.delete_pods.append((rehome.pod, "rendezvous closed; recreated"))
    plan.events.append(Event("Warning", "RendezvousClosed", f"{rehome.why}; recreating it"))


def _restart_stranded(plan: Plan, spec: SGDJobSpec, pods: Sequence[PodView], now: float) -> None:
    """Workers left waiting on a re-homed store's old connection: deleted (gracefully) and recreated."""
    grace = spec.run_policy.store_lost_grace_seconds
    ctl = controller(plan.status)
    stuck, why = stranded_workers(ctl, workers(pods), step=plan.status.step, now=now, grace_s=grace)
    deleting = {name for name, _ in plan.delete_pods}  # lost with their node this pass already
    stuck = [name for name in stuck if name not in deleting]
    if not stuck:
        return
    for name in stuck:
        plan.delete_pods.append((name, "stranded on a re-homed store; restarted"))
    plan.events.append(Event("Warning", "WorkersStranded", f"{why}; restarting them"))


def _replace_lost(
    plan: Plan,
    spec: SGDJobSpec,
    pods: Sequence[PodView],
    lost: Mapping[str, tuple[float, str]],
    now: float,
    answering: frozenset[str],
) -> None:
    """Pods on a node lost for nodeLostGraceSeconds: force-deleted, the node excluded, one Event per
    pod naming the node. Their replacements are created once the names are free (next pass).
    A pod that still answers (its node's kubelet stopped, its containers alive and reachable) is kept:
    the store because the agents hold connections to it and a second store would let a second world
    form beside theirs; a worker because it still trains in the world, and a replacement of its index
    would run beside it until its node's kubelet returns and kills it."""
    ctl = controller(plan.status)
    grace = spec.run_policy.node_lost_grace_seconds
    for gone in lost_pods(pods, lost, now=now, grace_s=grace):
        if gone.pod in plan.force_delete or gone.pod in answering:
            continue  # a store re-homed this pass already, or a pod that still answers
        why = f"node {gone.node} ({gone.how} since {rfc3339(gone.since)})"
        plan.delete_pods.append((gone.pod, f"lost with {why}; force-deleted and recreated"))
        plan.force_delete.add(gone.pod)
        if (store := next((p for p in rdzv_pods(pods) if p.name == gone.pod), None)) is not None:
            moved(ctl, store, now, f"rendezvous store {store.name} lost with {why}", plan.status.step)
        if gone.node not in excluded_names(ctl):
            exclude(ctl, gone.node, now, spec.policy.exclude_node_seconds, why, lost=True)
        plan.events.append(
            Event(
                "Warning", "NodeLost", f"pod {gone.pod} lost with {why}, {grace}s grace over; replaced on another node"
            )
        )


def plan_reconcile(
    spec: SGDJobSpec,
    status: SGDJobStatus,
    pods: Sequence[PodView],
    *,
    generation: int,
    now: float,
    queued: str = "",
    lost_nodes: Mapping[str, tuple[float, str]] | None = None,
    store_answered: bool | None = None,
    answering: frozenset[str] = frozenset(),
    ready_nodes: frozenset[str] = frozenset(),
) -> Plan:
    """One reconciliation step; `status` is not modified (the plan carries a copy). `queued` says why
    the job may not run yet though not suspended (waiting for Kueue admission); '' when it may.
    `lost_nodes`: the pods' nodes that are not Ready, with since when and how (`nodeloss.not_ready_since`);
    `store_answered`: whether the store's pod (`storeloss.store_to_probe`) answered its health check
    this pass (None: not tried); `answering`: the pods on lost nodes that answered this pass (a worker
    taking a connection at its metrics port, the store its health check), which are kept;
    `ready_nodes`: the nodes excluded as lost (`membership.lost_exclusions`) that are Ready again."""
    st = status.model_copy(deep=True)
    plan = Plan(status=st)
    st.observed_generation = max(st.observed_generation, generation)
    previous_phase = st.phase
    ws = workers(pods)
    rdzv = rdzv_pods(pods)
    _fill_counts(st, spec, ws)

    if st.phase not in FINISHED:
        _follow_spec_mode(st, spec, now, plan.events)
        _readmit_returned(plan, ready_nodes)
        _expire_exclusions(plan, spec, now)
        deadline = spec.run_policy.active_deadline_seconds
        started = parse_time(st.start_time)
        if deadline is not None and started is not None and now - started > deadline:
            plan.events.append(
                finish(
                    st,
                    Phase.FAILED,
                    "DeadlineExceeded",
                    f"the job ran longer than activeDeadlineSeconds ({deadline}s)",
                    now,
                )
            )
        else:
            _watch_store(plan, spec, pods, store_answered, now)
            _replace_lost(plan, spec, pods, lost_nodes or {}, now, answering)
            _restart_stranded(plan, spec, pods, now)
            _count_failures(plan, spec, pods, lost_nodes or {}, now)
            if st.phase not in FINISHED:
                _reopen_closed(plan, pods, now)

    if st.phase in FINISHED:
        _cleanup(plan, spec, pods)
        ttl = spec.run_policy.ttl_seconds_after_finished
        done = parse_time(st.completion_time)
        plan.delete_job = ttl is not None and done is not None and now >= done + ttl
        return plan

    if spec.run_policy.suspend or queued:
        _hold(plan, pods, previous_phase, queued if not spec.run_policy.suspend else "", now)
        return plan
    if previous_phase is Phase.SUSPENDED and _await_resume(plan, pods):
        return plan

    succeeded = [p for p in ws if p.phase == "Succeeded"]
    if succeeded:
        # torchrun agents exit 0 together when training is done; wait for the others, start nothing new.
        if not any(p.active for p in ws):
            # Workers exit 0 after the last step, or after rank 0's validation reached the target
            # (recorded from its /status while it ran). The last scrape came up to an interval
            # earlier, so without this `kubectl get` would show a finished job short of its steps.
            reason = "WorkersSucceeded"
            if st.target_step is None:
                _target_from_termination(st, succeeded)
            if st.target_step is not None:
                reason, st.step = TARGET_REACHED, max(st.step, st.target_step)
            else:
                st.step = max(st.step, spec.training.steps)
            message = f"{len(succeeded)} worker pods completed successfully"
            plan.events.append(finish(st, Phase.SUCCEEDED, reason, message, now))
            _cleanup(plan, spec, pods)
            return plan
    else:
        _plan_membership(plan, spec, ws)
        if not rdzv:
            plan.create_rdzv = True
        for pod in rdzv:
            if pod.phase in ("Failed", "Succeeded") and not pod.deleting and pod.name not in plan.force_delete:
                plan.delete_pods.append((pod.name, "rendezvous pod ended; recreated"))

    if st.start_time is None and st.ready_replicas >= spec.min_workers:
        st.start_time = rfc3339(now)
    phase, reason, why = phase_for(st, spec, pods)
    if succeeded and phase is Phase.ADAPTING:
        phase, reason, why = Phase.RUNNING, "", ""  # finishing, not adapting: the others are about to exit too
        st.message = f"completing: {len(succeeded)} of {len(ws)} workers finished"
    st.phase = phase
    if previous_phase is Phase.SUSPENDED:
        plan.events.append(
            Event("Normal", "Admitted", "admitted by Kueue: worker pods created")
            if _was_queued(status)
            else Event("Normal", "Resumed", "job resumed: worker pods recreated")
        )
    # A command-mode script that does not report to SGDJob: say what that turns off where users look.
    note = f"; {COMMAND_MODE_NOTE}" if not spec.training.reports else ""
    if phase is not previous_phase and phase in (Phase.RUNNING, Phase.ADAPTING):
        ready = f"{st.ready_replicas} workers ready" + (note or f" in mode {st.mode or st.target_mode}")
        plan.events.append(Event("Normal", phase.value, why or ready))
    if not succeeded:
        st.message = why or (
            f"{st.ready} workers ready{note}"
            if phase is not Phase.PENDING
            else f"waiting for workers: {st.ready} ready, at least {spec.min_workers} needed"
        )
    st.conditions = merge_conditions(
        st.conditions,
        desired_conditions(
            phase,
            created=True,
            adapting_reason=reason,
            message=st.message,
            hung=hang_condition(st),
        ),
        now,
    )
    return plan


def _was_queued(status: SGDJobStatus) -> bool:
    return any(c.type == "Suspended" and c.status == "True" and c.reason == QUEUED for c in status.conditions)


def _hold(plan: Plan, pods: Sequence[PodView], previous_phase: Phase, queued: str, now: float) -> None:
    """No pods while suspended or queued: Suspended phase (as Kubernetes and Kubeflow jobs show a job
    Kueue holds), with the Suspended condition's reason telling the user's suspend from the queue's."""
    st = plan.status
    why = "waiting for Kueue admission" if queued else "job suspended"
    for pod in pods:
        if not pod.deleting:
            plan.delete_pods.append((pod.name, why))
    was_queued = _was_queued(st)
    st.phase = Phase.SUSPENDED
    st.start_time = None  # as for Kubernetes Jobs: the deadline counts from the resume
    st.message = (
        f"queued: {queued}; no worker pods until admitted"
        if queued
        else ("suspended: worker pods removed, checkpoints kept")
    )
    st.conditions = merge_conditions(
        st.conditions,
        desired_conditions(
            Phase.SUSPENDED,
            created=True,
            adapting_reason="",
            message=st.message,
            suspended_reason=QUEUED if queued else "JobSuspended",
            hung=hang_condition(st),
        ),
        now,
    )
    if queued and (previous_phase is not Phase.SUSPENDED or not was_queued):
        plan.events.append(Event("Normal", QUEUED, st.message))
    elif not queued and (previous_phase is not Phase.SUSPENDED or was_queued):
        plan.events.append(Event("Normal", "Suspended", st.message))


def _await_resume(plan: Plan, pods: Sequence[PodView]) -> bool:
    """A resumed (or admitted) job's pods start only once every pod of its suspension has ended: an agent
    still stopping would join the new store's first rendezvous round (its name is taken until it ends
    anyway), and a store still stopping would answer the new workers. Whether it waits."""
    ending = [p.name for p in pods if p.deleting]
    if not ending:
        return False
    plan.status.message = f"resuming: waiting for {len(ending)} pods of the suspension to end ({', '.join(ending)})"
    return True


def count_pods(st: SGDJobStatus, spec: SGDJobSpec, pods: Sequence[PodView]) -> None:
    """The printer counts again, for pods the pass has just created: status is then right at once,
    and their creation needs no pass of its own."""
    _fill_counts(st, spec, workers(pods))


def _fill_counts(st: SGDJobStatus, spec: SGDJobSpec, ws: Sequence[PodView]) -> None:
    """Printer fields: pods that exist, pods ready, 'ready/desired'."""
    live = [p for p in ws if p.active]
    st.replicas = len(live)
    st.ready_replicas = sum(1 for p in live if p.phase == "Running" and p.ready)
    st.ready = f"{st.ready_replicas}/{spec.replicas}"


def _plan_membership(plan: Plan, spec: SGDJobSpec, ws: Sequence[PodView]) -> None:
    """The wanted worker indices exist (`membership.wanted_indices`: kubectl scale and Rescale both
    land here), no others, and none on a node the job is kept off. A name still held by a
    terminating pod is created next time."""
    ctl = controller(plan.status)
    wanted = wanted_indices(ctl, spec.replicas)
    store_indices(ctl, wanted)
    excluded = set(excluded_names(ctl))
    doomed = {name for name, _ in plan.delete_pods}
    for pod in ws:
        if pod.deleting or pod.name in doomed or pod.index is None:
            continue
        if pod.index not in wanted:
            plan.delete_pods.append((pod.name, f"scaled down to {spec.replicas} replicas"))
        elif pod.node is not None and pod.node in excluded and pod.phase != "Succeeded":
            plan.delete_pods.append((pod.name, f"node {pod.node} excluded for this job; replaced"))
        elif pod.node is None and pod.phase == "Pending" and (freed := sorted(set(pod.excluded) - excluded)):
            # Unscheduled, perhaps for want of the nodes it stays off: those may take it again.
            plan.delete_pods.append((pod.name, f"exclusion of {', '.join(freed)} ended; recreated"))
    held = {p.index for p in ws}
    plan.create_workers = [i for i in wanted if i not in held]


def _readmit_returned(plan: Plan, ready: frozenset[str]) -> None:
    """Lost nodes Ready again are no longer excluded, each with an Event: the job grows back onto them
    (a replacement left Pending for want of them is recreated by `_plan_membership`)."""
    for back in readmit(controller(plan.status), ready):
        since = f" since {back.since}" if back.since else ""
        message = f"node {back.node} Ready again; no longer excluded (lost{since}: {back.reason})"
        plan.events.append(Event("Normal", "NodeReadmitted", message))


def _expire_exclusions(plan: Plan, spec: SGDJobSpec, now: float) -> None:
    """Exclusions past policy.excludeNodeSeconds end, each with an Event."""
    for gone in expire(controller(plan.status), now, spec.policy.exclude_node_seconds):
        since = f" since {gone.since}" if gone.since else ""
        message = f"node {gone.node} no longer excluded (excluded{since}: {gone.reason or 'slow node'})"
        plan.events.append(Event("Normal", "NodeExclusionExpired", message))


def _target_from_termination(st: SGDJobStatus, succeeded: Sequence[PodView]) -> None:
    """A target reached after the last scrape: rank 0's termination message says so (pure)."""
    for pod in succeeded:
        end = parse_termination(pod.message) if pod.message else None
        if end is not None and end.end_reason == TARGET_REACHED and end.target_step is not None:
            st.target_step = end.target_step
            if end.time_to_target_s is not None:
                st.time_to_target_seconds = max(0.0, min(1e9, end.time_to_target_s))
            return
