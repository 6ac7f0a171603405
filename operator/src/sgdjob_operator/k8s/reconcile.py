"""The imperative shell around the pure core: one reconciliation pass of one SGDJob.

A pass reads the job from the API (never from a cache that could be stale after our own status write)
and its pods from the API server's watch cache, unless pods it created are not yet seen there (then
from etcd: a cache that lags our own creates would make the plan create them again). It scrapes the
workers when the policy interval is due, plans with the pure functions and carries the plan out
through the one API wrapper. What it keeps between passes is in `runtime.Runtime`; the policy's part
of a pass is in `monitor`, its probes of nodes, store and pods in `probes`, its status and Event
writes in `publish`.
"""

from __future__ import annotations

import asyncio
import time

from sgdjob_operator.api.models import Phase, SGDJobSpec, SGDJobStatus
from sgdjob_operator.api.validation import WARNING_REASONS, SpecError, spec_warnings, validate_spec
from sgdjob_operator.k8s import metrics
from sgdjob_operator.k8s.actuator import Outcome, stored_policy_state, take_policy_state
from sgdjob_operator.k8s.builders import (
    POLICY_STATE_KEY,
    JobRef,
    build_policy_state,
    build_rdzv_pod,
    build_worker_pod,
)
from sgdjob_operator.k8s.children import ensure_children
from sgdjob_operator.k8s.client import core_path
from sgdjob_operator.k8s.membership import excluded_names, lost_exclusions
from sgdjob_operator.k8s.monitor import monitor
from sgdjob_operator.k8s.plan import count_pods, plan_reconcile
from sgdjob_operator.k8s.probes import (
    answering_on_lost_nodes,
    departing_agents,
    lost_nodes,
    probe_store,
    ready_again,
)
from sgdjob_operator.k8s.publish import event_once, post_events, write_status
from sgdjob_operator.k8s.queueing import QUEUED_POLL_S, Gate, ensure_pod_group, kueue_gate
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.status import (
    FINISHED,
    Event,
    PodView,
    controller,
    load_status,
    mark_invalid,
    parse_time,
)
from sgdjob_operator.k8s.storeloss import store_excluded


async def reconcile(rt: Runtime, ref: JobRef) -> float | None:
    """One pass; returns seconds until the next one is due (None: the job is gone)."""
    started = time.perf_counter()
    body = await rt.kube.get_job(ref)
    if body is None or body["metadata"].get("uid") != ref.uid:
        return None
    if body["metadata"].get("deletionTimestamp"):
        return None
    key = (ref.namespace, ref.name)
    generation = int(body["metadata"].get("generation") or 0)
    rt.generations[key] = generation
    raw_status = body.get("status") or {}
    st = load_status(raw_status)
    legacy = take_policy_state(st)
    if legacy is not None:  # an older operator's, in status: moved before a status write drops it
        await rt.kube.create(build_policy_state(ref, legacy))
    now = time.time()
    events: list[Event] = []
    try:
        spec = validate_spec(body.get("spec") or {})
    except SpecError as err:
        events = mark_invalid(st, err.problems, now)
        st.observed_generation = generation
        await write_status(rt, ref, raw_status, st, events)
        return rt.settings.resync_s
    if st.phase is Phase.FAILED and any(c.type == "Failed" and c.reason == "InvalidSpec" for c in st.conditions):
        st = SGDJobStatus(
            restarts=st.restarts, decisions=st.decisions, controller=st.controller
        )  # fixed spec: start over
    # A new generation (say, training.steps edited while suspended) reaches the ConfigMap before this
    # pass creates any pod: the update handler does it too, but may run after this pass.
    stale = time.monotonic() - rt.last_ensure.get(ref.uid, -1e9) > rt.settings.resync_s
    if (stale or rt.ensured_generation.get(ref.uid) != generation) and st.phase not in FINISHED:
        await ensure_children(rt, ref, spec, st, reassert=ref.uid in rt.last_ensure)
        rt.ensured_generation[ref.uid] = generation
    pods = [PodView.from_obj(p) for p in await rt.kube.job_pods(ref, cached=not rt.awaits_pods(ref))]
    gate = Gate()
    await kueue_gate(
        rt.kube,
        ref,
        spec,
        body["metadata"].get("labels") or {},
        finished=st.phase in FINISHED,
        image=rt.settings.trainer_image,
        gate=gate,
    )
    outcome: Outcome | None = None
    policy_path = f"{core_path(ref.namespace, 'configmaps')}/{ref.policy_state}"
    policy_before = policy_after = None
    due = rt.next_monitor.get(ref.uid, 0.0)
    held = spec.run_policy.suspend or bool(gate.queued)
    if st.phase in (Phase.RUNNING, Phase.ADAPTING) and time.monotonic() >= due and not held:
        rt.next_monitor[ref.uid] = time.monotonic() + spec.policy.interval_seconds
        policy_before = stored_policy_state(await rt.kube.get(policy_path))
        controller(st).policy_state = policy_before
        born = parse_time(body["metadata"].get("creationTimestamp"))
        outcome, events, spec = await monitor(rt, ref, spec, st, pods, now, born)
        policy_after = take_policy_state(st)
    elif held or st.phase not in (Phase.RUNNING, Phase.ADAPTING):
        rt.failing_since.pop(ref.uid, None)  # not scraped now: a silent worker's grace starts over
    if st.phase not in FINISHED and not held:
        await ensure_pod_group(rt.kube, ref, spec, gate)  # after monitor: minMember follows its rescale
    events += gate.events + await event_once(rt, ref, "SchedulingFailed", gate.problem)
    lost = await lost_nodes(rt, pods) if st.phase not in FINISHED else {}
    # Before this pass deletes a pod the policy's rescale removed: the survivors' next rendezvous
    # round then completes at the new size, with no last call for the pod that is gone.
    probing = st.phase in (Phase.RUNNING, Phase.ADAPTING) and not held
    answered = await probe_store(rt, pods, nodes=spec.replicas) if probing else None
    answering = await answering_on_lost_nodes(rt, spec, pods, lost, answered)
    ready = await ready_again(rt, lost_exclusions(controller(st))) if st.phase not in FINISHED else frozenset()
    plan = plan_reconcile(
        spec,
        st,
        pods,
        generation=generation,
        now=now,
        queued=gate.queued,
        lost_nodes=lost,
        store_answered=answered,
        answering=answering,
        ready_nodes=ready,
    )
    if kept := sorted(answering):
        kept_on = sorted({p.node or "" for p in pods if p.name in answering})
        events += await event_once(
            rt, ref, "NodeLostPodsAnswer",
            f"node {', '.join(kept_on)} not Ready, but {', '.join(kept)} still answer: kept until they stop answering",
        )  # fmt: skip
    else:
        events += await event_once(rt, ref, "NodeLostPodsAnswer", "")
    if not gate.ready:
        plan.create_workers = []  # a gang's pods wait for their PodGroup, or a scheduler could split them
    excluded = excluded_names(controller(plan.status))
    creates = [
        build_worker_pod(ref, spec, i, default_image=rt.settings.trainer_image, excluded_nodes=excluded)
        for i in plan.create_workers
    ]
    if plan.create_rdzv:
        avoid = store_excluded(controller(plan.status), excluded)
        creates.append(build_rdzv_pod(ref, spec, default_image=rt.settings.trainer_image, excluded_nodes=avoid))
    expected = [(ref.namespace, str(pod["metadata"]["name"])) for pod in creates]
    rt.expected_pods.update(expected)
    results = await asyncio.gather(*(rt.kube.create(pod) for pod in creates), return_exceptions=True)
    failed = [
        f"{pod['metadata']['name']}: {result}"
        for pod, result in zip(creates, results, strict=True)
        if isinstance(result, BaseException)
    ]
    created: list[PodView] = []
    for pod_key, pod, result in zip(expected, creates, results, strict=True):
        if result is True:
            metrics.PODS_CREATED.labels(role=pod["metadata"]["labels"].get("sgdjob.dev/role", "worker")).inc()
            created.append(PodView.from_obj(pod))  # as created: Pending, on no node yet
        else:
            rt.expected_pods.discard(pod_key)  # not created (exists, refused): its events are news
    if created:
        count_pods(plan.status, spec, [*pods, *created])
    # Admission refusals repeat every pass until someone fixes the cause: one Event per distinct cause.
    events += await event_once(
        rt, ref, "CreateFailed", f"cannot create {len(failed)} pods; first: {failed[0]}" if failed else ""
    )
    deletes = list(plan.delete_pods)
    if outcome is not None and outcome.delete_pod and outcome.delete_pod not in {n for n, _ in deletes}:
        deletes.append((outcome.delete_pod, "replaced by the policy"))
    # Before the deletes: the removed agents' peers re-form the world without waiting for their heartbeats.
    if probing and (departed := departing_agents(pods, {n for n, _ in deletes}, lost)):
        await probe_store(rt, pods, nodes=spec.replicas, departed=departed)
    for name, why in deletes:
        # Grace 0 for a pod on a lost node: no kubelet will ever confirm a graceful stop.
        if await rt.kube.delete("Pod", ref.namespace, name, grace_s=0 if name in plan.force_delete else None):
            metrics.PODS_DELETED.labels(why=metrics.reason_label(why)).inc()
    if plan.status.phase not in FINISHED:
        # Allowed, but not doing what the spec asks: one Warning per cause, again only if its text
        # changes (or this operator restarts: the memory of what was posted is the process's).
        warned = {w.reason: w.message for w in spec_warnings(spec)}
        for reason in WARNING_REASONS:
            events += await event_once(rt, ref, reason, warned.get(reason, ""))
    await write_status(rt, ref, raw_status, plan.status, events + plan.events)
    # After status: a restart in between loses one interval of the policy's memory, never a decision.
    if policy_after is not None and policy_after != policy_before:
        if policy_before is not None:
            await rt.kube.patch(policy_path, {"data": {POLICY_STATE_KEY: policy_after}})
        else:
            await rt.kube.create(build_policy_state(ref, policy_after))
    rt.phases[key] = plan.status.phase.value
    metrics.set_job(ref.namespace, ref.name, plan.status)
    metrics.set_phases(rt.phases.values())
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
    if plan.delete_job:
        await post_events(
            rt,
            ref,
            [
                Event(
                    "Normal",
                    "Deleted",
                    f"ttlSecondsAfterFinished ({spec.run_policy.ttl_seconds_after_finished}s) elapsed",
                )
            ],
        )
        await rt.kube.delete_job(ref)
        return None
    delay = next_delay(rt, ref, spec, plan.status, pods)
    if plan.force_delete:
        delay = min(delay, 1.0)  # the names are free now: their replacements are created next pass
    elif lost:
        # A lost node's pods are replaced when its grace is up, which no watch event announces.
        delay = min(
            delay,
            max(
                rt.settings.min_tick_s,
                min(s for s, _ in lost.values()) + spec.run_policy.node_lost_grace_seconds - now + 0.5,
            ),
        )
    silence = controller(plan.status).store_silence
    if silence is not None and (since := parse_time(silence.since)) is not None:
        # The store's grace ends at a time no watch event announces.
        delay = min(delay, max(rt.settings.min_tick_s, since + spec.run_policy.store_lost_grace_seconds - now + 0.5))
    if (gate.queued and not spec.run_policy.suspend) or not gate.ready:
        delay = min(delay, QUEUED_POLL_S)  # Kueue's and the schedulers' objects are polled, not watched
    return min(delay, 5.0) if failed else delay


def next_delay(rt: Runtime, ref: JobRef, spec: SGDJobSpec, st: SGDJobStatus, pods: list[PodView]) -> float:
    delay = rt.settings.resync_s
    if st.phase in (Phase.RUNNING, Phase.ADAPTING):
        delay = min(delay, max(0.0, rt.next_monitor.get(ref.uid, 0.0) - time.monotonic()) + 0.01)
    ttl = spec.run_policy.ttl_seconds_after_finished
    if st.phase in FINISHED and ttl is not None:
        delay = min(delay, float(ttl) + 0.5)
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is not None and st.start_time and st.phase not in FINISHED:
        delay = min(delay, float(deadline) + 0.5)
    if any(p.deleting for p in pods):
        # A terminating name is recreated as soon as it is free, and a resume waits for the suspension's
        # pods, the store's included, to end (plan._await_resume).
        delay = min(delay, 1.0)
    return max(delay, rt.settings.min_tick_s)
