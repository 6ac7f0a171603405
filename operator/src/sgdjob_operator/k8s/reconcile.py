"""The imperative shell around the pure core: one reconciliation pass of one SGDJob.

A pass reads the job from the API (never from a cache that could be stale after our own status write)
and its pods from the API server's watch cache, unless pods it created are not yet seen there (then
from etcd: a cache that lags our own creates would make the plan create them again). It scrapes the
workers when the policy interval is due, plans with the pure functions and carries the plan out
through the one API wrapper. What it keeps between passes is in `runtime.Runtime`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from sgdjob_operator.api.models import Phase, SGDJobSpec, SGDJobStatus
from sgdjob_operator.api.validation import WARNING_REASONS, SpecError, spec_warnings, validate_spec
from sgdjob_operator.k8s import metrics
from sgdjob_operator.k8s.actuator import (
    Outcome,
    apply_step,
    evaluate_job,
    first_pass_wait,
    stored_policy_state,
    take_policy_state,
)
from sgdjob_operator.k8s.builders import (
    POLICY_STATE_KEY,
    RDZV_PORT,
    JobRef,
    build_policy_state,
    build_rdzv_pod,
    build_worker_pod,
)
from sgdjob_operator.k8s.children import ensure_children, job_token
from sgdjob_operator.k8s.client import ApiError, core_path
from sgdjob_operator.k8s.membership import excluded_names
from sgdjob_operator.k8s.nodeloss import not_ready_since
from sgdjob_operator.k8s.observe import (
    Observation,
    command_to_push,
    endpoints,
    observe,
    quiet_reason,
    record_observation,
    unanswered,
)
from sgdjob_operator.k8s.plan import count_pods, plan_reconcile
from sgdjob_operator.k8s.queueing import QUEUED_POLL_S, Gate, ensure_pod_group, kueue_gate
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.status import (
    FINISHED,
    Event,
    PodView,
    controller,
    dump_status,
    finish,
    in_flight,
    load_status,
    parse_time,
)
from sgdjob_operator.k8s.status import workers as worker_pods
from sgdjob_operator.k8s.storeloss import store_excluded, store_to_probe
from sgdjob_operator.workers.scrape import post_control

log = logging.getLogger("sgdjob_operator")
# A pod on a live node accepts within milliseconds; a powered-off or cut-off one never answers.
POD_PROBE_TIMEOUT_S = 2.0


async def post_events(rt: Runtime, ref: JobRef, events: list[Event]) -> None:
    for ev in events:
        try:
            await rt.kube.post_event(ref, ev.type, ev.reason, ev.message)
        except ApiError as err:  # an Event is worth a log line, never a failed pass
            log.warning("cannot post event %s for %s/%s: %s", ev.reason, ref.namespace, ref.name, err)
        (log.warning if ev.type == "Warning" else log.info)(
            "%s/%s %s: %s", ref.namespace, ref.name, ev.reason, ev.message
        )


async def _once(rt: Runtime, ref: JobRef, kind: str, message: str, ev_type: str = "Warning") -> list[Event]:
    """An Event for a condition that repeats every pass (a worker that cannot be scraped): posted when
    the condition's text changes, not every time."""
    key = (ref.uid, kind)
    if rt.noisy.get(key) == message:
        return []
    rt.noisy[key] = message
    return [Event(ev_type, kind, message)] if message else []


async def _monitor(
    rt: Runtime, ref: JobRef, spec: SGDJobSpec, st: SGDJobStatus, pods: list[PodView], now: float
) -> tuple[Outcome | None, list[Event], SGDJobSpec]:
    """Scrape, evaluate, apply the decision to `st`, push the desired command. Returns the outcome,
    Events, and the spec as it now stands (a rescale changes replicas)."""
    eps = endpoints(spec, pods, host=rt.settings.scrape_host, scheme=rt.settings.scrape_scheme)
    if not eps:
        rt.failing_since.pop(ref.uid, None)
        return None, [], spec
    obs: Observation = await observe(eps, now=now, timeout=rt.settings.scrape_timeout_s, session=rt.http)
    events: list[Event] = []
    if obs.errors:
        metrics.SCRAPE_ERRORS.inc(len(obs.errors))
    rt.failing_since[ref.uid], late = unanswered(
        obs.errors,
        eps,
        pods,
        rt.failing_since.get(ref.uid, {}),
        now=now,
        grace_s=rt.settings.scrape_grace_s,
        quiet=quiet_reason(st, spec, pods),
    )
    if obs.errors and not late:
        log.info("%s/%s: %d of %d workers not answering yet", ref.namespace, ref.name, len(obs.errors), len(eps))
    events += await _once(rt, ref, "ScrapeFailed", late)
    if not obs.samples:
        return None, events, spec
    wait = first_pass_wait(spec, st, obs)
    if wait > 0:
        # The workers began training less than half an interval ago: evaluated now, they would get a
        # baseline and their first rate an interval later; a pass at the right time gives it at once.
        rt.next_monitor[ref.uid] = time.monotonic() + wait
        return None, events, spec
    busy = in_flight(st, spec, pods)
    step, problem = evaluate_job(spec, st, obs, now, busy)
    events += await _once(rt, ref, "PolicyError", problem)
    events += record_observation(st, obs, step.health, spec)
    outcome = apply_step(st, step, now, spec, pods)
    if outcome.applied:
        metrics.DECISIONS.labels(action=outcome.applied, reason=metrics.reason_label(step.decision.reason)).inc()
    else:
        log.debug("%s/%s: keep: %s", ref.namespace, ref.name, step.decision.reason)
    if outcome.held:
        metrics.DEFERRED.labels(action=outcome.held).inc()
        why = busy or "control command not applied yet"
        log.info("%s/%s: %s held back (%s)", ref.namespace, ref.name, outcome.held, why)
    if outcome.scale_to is not None:
        # Status first: it names the pods that go (workerIndices); a restart between the two writes
        # then finds either no change at all or both, never replicas lowered without the names.
        await rt.kube.patch_job_status(ref, dump_status(st))
        if await rt.kube.scale_job(ref, outcome.scale_to) is not None:
            spec = spec.model_copy(update={"replicas": outcome.scale_to})
    command = command_to_push(st, obs)
    if command is not None and obs.control is not None:
        token = await job_token(rt, ref)
        result = await post_control(
            obs.control, command, token or "", timeout=rt.settings.scrape_timeout_s, session=rt.http
        )
        metrics.CONTROL_PUSHES.labels(result=str(result.status) if result.status else "error").inc()
        bad = (
            ""
            if result.accepted
            else (
                f"POST {obs.control.url}/control epoch {command.epoch}: "
                f"{result.error or f'HTTP {result.status} {result.body[:200]}'}"
            )
        )
        events += await _once(rt, ref, "ControlPushFailed", bad)
    if outcome.config_changed:
        await ensure_children(rt, ref, spec, st)
    return outcome, events + outcome.events, spec


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
        await _write(rt, ref, raw_status, st, events)
        return rt.settings.resync_s
    if st.phase is Phase.FAILED and any(c.type == "Failed" and c.reason == "InvalidSpec" for c in st.conditions):
        st = SGDJobStatus(
            restarts=st.restarts, decisions=st.decisions, controller=st.controller
        )  # fixed spec: start over
    if time.monotonic() - rt.last_ensure.get(ref.uid, -1e9) > rt.settings.resync_s and st.phase not in FINISHED:
        await ensure_children(rt, ref, spec, st, reassert=ref.uid in rt.last_ensure)
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
        outcome, events, spec = await _monitor(rt, ref, spec, st, pods, now)
        policy_after = take_policy_state(st)
    elif held or st.phase not in (Phase.RUNNING, Phase.ADAPTING):
        rt.failing_since.pop(ref.uid, None)  # not scraped now: a silent worker's grace starts over
    if st.phase not in FINISHED and not held:
        await ensure_pod_group(rt.kube, ref, spec, gate)  # after _monitor: minMember follows its rescale
    events += gate.events + await _once(rt, ref, "SchedulingFailed", gate.problem)
    lost = await lost_nodes(rt, pods) if st.phase not in FINISHED else {}
    answered = await probe_store(rt, pods) if st.phase in (Phase.RUNNING, Phase.ADAPTING) and not held else None
    answering = await answering_on_lost_nodes(rt, spec, pods, lost, answered)
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
    )
    if kept := sorted(answering):
        kept_on = sorted({p.node or "" for p in pods if p.name in answering})
        events += await _once(
            rt, ref, "NodeLostPodsAnswer",
            f"node {', '.join(kept_on)} not Ready, but {', '.join(kept)} still answer: kept until they stop answering",
        )  # fmt: skip
    else:
        events += await _once(rt, ref, "NodeLostPodsAnswer", "")
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
    events += await _once(
        rt, ref, "CreateFailed", f"cannot create {len(failed)} pods; first: {failed[0]}" if failed else ""
    )
    deletes = list(plan.delete_pods)
    if outcome is not None and outcome.delete_pod and outcome.delete_pod not in {n for n, _ in deletes}:
        deletes.append((outcome.delete_pod, "replaced by the policy"))
    for name, why in deletes:
        # Grace 0 for a pod on a lost node: no kubelet will ever confirm a graceful stop.
        if await rt.kube.delete("Pod", ref.namespace, name, grace_s=0 if name in plan.force_delete else None):
            metrics.PODS_DELETED.labels(why=metrics.reason_label(why)).inc()
    if plan.status.phase not in FINISHED:
        # Allowed, but not doing what the spec asks: one Warning per cause, again only if its text
        # changes (or this operator restarts: the memory of what was posted is the process's).
        warned = {w.reason: w.message for w in spec_warnings(spec)}
        for reason in WARNING_REASONS:
            events += await _once(rt, ref, reason, warned.get(reason, ""))
    await _write(rt, ref, raw_status, plan.status, events + plan.events)
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


async def _accepts(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), POD_PROBE_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def probe_store(rt: Runtime, pods: list[PodView]) -> bool | None:
    """Whether the store's pod accepts a TCP connection (None: no running store, or an operator that
    reaches pods through SGDJOB_SCRAPE_HOST, which cannot address the store)."""
    store = store_to_probe(pods)
    if store is None or store.ip is None or rt.settings.scrape_host:
        return None
    return await _accepts(store.ip, RDZV_PORT)


async def answering_on_lost_nodes(
    rt: Runtime, spec: SGDJobSpec, pods: list[PodView], lost: Mapping[str, object], store_answered: bool | None
) -> frozenset[str]:
    """The pods on lost nodes that still take a connection: a worker at its (first) metrics port, the
    store as `probe_store` found it. An operator that reaches pods through SGDJOB_SCRAPE_HOST cannot
    address one pod: none then."""
    if not lost or rt.settings.scrape_host:
        return frozenset()
    store = store_to_probe(pods)
    found = {store.name} if store is not None and store.node in lost and store_answered else set()
    on_lost = [p for p in worker_pods(pods) if p.node in lost and p.ip and p.phase == "Running"]
    accepted = await asyncio.gather(*(_accepts(p.ip or "", spec.training.metrics_port) for p in on_lost))
    found |= {p.name for p, ok in zip(on_lost, accepted, strict=True) if ok}
    return frozenset(found)


async def lost_nodes(rt: Runtime, pods: list[PodView]) -> dict[str, tuple[float, str]]:
    """The not-Ready nodes among those the job's pods are bound to (a cached GET per node: the
    watch cache's Node objects are as fresh as the node controller's writes)."""
    names = sorted({p.node for p in pods if p.node and p.phase not in ("Succeeded", "Failed")})
    found = await asyncio.gather(*(rt.kube.get_node(n) for n in names))
    out: dict[str, tuple[float, str]] = {}
    for name, node in zip(names, found, strict=True):
        state = not_ready_since(node)
        if state is not None:
            out[name] = state
    return out


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
    if any(p.deleting for p in worker_pods(pods)):
        delay = min(delay, 1.0)  # a terminating name is recreated as soon as it is free
    return max(delay, rt.settings.min_tick_s)


def mark_invalid(st: SGDJobStatus, problems: list[str], now: float) -> list[Event]:
    """A spec the schema accepted but the cross-field rules refuse: Failed, naming the fields."""
    message = "invalid spec: " + "; ".join(problems)
    already = st.phase is Phase.FAILED and st.message == message
    event = finish(st, Phase.FAILED, "InvalidSpec", message, now)
    st.message = message
    return [] if already else [event]


def _pruned(value: Any) -> Any:
    """JSON as the API server stores it after a merge patch: no null members."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


async def _write(rt: Runtime, ref: JobRef, before: dict[str, Any], st: SGDJobStatus, events: list[Event]) -> None:
    """Write status only when it changed (each write wakes every watcher), then post the Events:
    a decision is in status before anyone hears of it."""
    after = dump_status(st)
    if _pruned(after) != _pruned(before):
        await rt.kube.patch_job_status(ref, after)
    await post_events(rt, ref, events)
