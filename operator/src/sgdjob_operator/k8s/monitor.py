"""The policy's part of a pass (due every policy interval while the job runs): scrape the workers,
evaluate, apply the decision to status, rescale, and push the desired command to the workers."""

from __future__ import annotations

import logging
import time

from sgdjob_operator.api.models import SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s import metrics
from sgdjob_operator.k8s.actuator import Outcome, apply_step, evaluate_job, first_pass_wait, give_back
from sgdjob_operator.k8s.builders import JobRef
from sgdjob_operator.k8s.children import ensure_children, job_token
from sgdjob_operator.k8s.in_flight import policy_in_flight, refused_pods
from sgdjob_operator.k8s.membership import unplaced_growth
from sgdjob_operator.k8s.observe import (
    Observation,
    command_to_push,
    endpoints,
    observe,
    quiet_reason,
    record_observation,
    unanswered,
)
from sgdjob_operator.k8s.publish import event_once
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.status import Event, PodView, controller, dump_status
from sgdjob_operator.workers.scrape import post_control

log = logging.getLogger("sgdjob_operator")


async def monitor(
    rt: Runtime, ref: JobRef, spec: SGDJobSpec, st: SGDJobStatus, pods: list[PodView], now: float, created: float | None
) -> tuple[Outcome | None, list[Event], SGDJobSpec]:
    """Scrape, evaluate, apply the decision to `st`, push the desired command. Returns the outcome,
    Events, and the spec as it now stands (a rescale changes replicas)."""
    back = unplaced_growth(spec, controller(st), pods, now)
    if back is not None:
        # Before any scrape: a pod that waits for a node would hold every change of the policy.
        outcome = give_back(st, spec, back, now)
        metrics.DECISIONS.labels(action="rescale", reason="growth given back").inc()
        spec = await _scale(rt, ref, spec, st, back.replicas)
        return outcome, outcome.events, spec
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
    events += await event_once(rt, ref, "ScrapeFailed", late)
    if not obs.samples:
        return None, events, spec
    wait = first_pass_wait(spec, st, obs)
    if wait > 0:
        # The workers began training less than half an interval ago: evaluated now, they would get a
        # baseline and their first rate an interval later; a pass at the right time gives it at once.
        rt.next_monitor[ref.uid] = time.monotonic() + wait
        return None, events, spec
    busy = policy_in_flight(st, spec, pods, now)
    refused = len(refused_pods(spec, pods, now))
    step, problem = evaluate_job(spec, st, obs, now, busy, created, refused)
    events += await event_once(rt, ref, "PolicyError", problem)
    events += record_observation(st, obs, step.health, spec)
    outcome = apply_step(st, step, now, spec, pods)
    if outcome.applied:
        metrics.DECISIONS.labels(action=outcome.applied, reason=metrics.reason_label(step.decision.reason)).inc()
    else:
        log.debug("%s/%s: keep: %s", ref.namespace, ref.name, step.decision.reason)
    if step.health is not None and log.isEnabledFor(logging.DEBUG):  # the line is long: built only when logged
        log.debug("%s/%s: ranks at step %d: %s", ref.namespace, ref.name, step.health.step, step.health.rank_line())
    if outcome.held:
        metrics.DEFERRED.labels(action=outcome.held).inc()
        why = busy or "control command not applied yet"
        log.info("%s/%s: %s held back (%s)", ref.namespace, ref.name, outcome.held, why)
    if outcome.scale_to is not None:
        spec = await _scale(rt, ref, spec, st, outcome.scale_to)
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
        events += await event_once(rt, ref, "ControlPushFailed", bad)
    if outcome.config_changed:
        await ensure_children(rt, ref, spec, st)
    return outcome, events + outcome.events, spec


async def _scale(rt: Runtime, ref: JobRef, spec: SGDJobSpec, st: SGDJobStatus, replicas: int) -> SGDJobSpec:
    """Status first: it names the pods that go (workerIndices); a restart between the two writes
    then finds either no change at all or both, never replicas lowered without the names."""
    await rt.kube.patch_job_status(ref, dump_status(st))
    if await rt.kube.scale_job(ref, replicas) is not None:
        return spec.model_copy(update={"replicas": replicas})
    return spec
