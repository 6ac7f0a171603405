"""The operator side of `bench.pass_cost`, the parent process: one running job as the operator
holds it between passes (`Job`) and one policy pass of it as `k8s.reconcile.reconcile` /
`k8s.monitor.monitor` make it (`one_pass`), each phase timed in process CPU (`PassCost`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.pass_cost_workers import BATCH, JOB_STEPS
from sgdjob_operator.api.models import Phase, SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.actuator import apply_step, evaluate_job, first_pass_wait, take_policy_state
from sgdjob_operator.k8s.builders import ROLE_WORKER
from sgdjob_operator.k8s.in_flight import in_flight
from sgdjob_operator.k8s.observe import command_to_push, observe, quiet_reason, record_observation, unanswered
from sgdjob_operator.k8s.publish import pruned
from sgdjob_operator.k8s.status import PodView, controller, dump_status, load_status, rfc3339
from sgdjob_operator.workers.scrape import Endpoint, SampleSource, post_control

# The operator's defaults (k8s.settings.Settings, k8s.handlers.startup).
SCRAPE_TIMEOUT_S = 2.0
SCRAPE_GRACE_S = 120.0
CONNECTION_LIMIT = 256


def job_spec(n: int) -> SGDJobSpec:
    """An auto job of n one-process nodes at the shipping policy defaults; replicas fixed (min =
    max), since this bench has no API server to carry a rescale out."""
    doc = {
        "replicas": n,
        "minReplicas": n,
        "maxReplicas": n,
        "mode": "auto",
        "training": {"batchSize": BATCH, "steps": JOB_STEPS},
    }
    return SGDJobSpec.model_validate(doc)


def job_pods(n: int) -> list[PodView]:
    return [
        PodView(f"job-worker-{r}", f"uid-{r}", ROLE_WORKER, r, "Running", True, "127.0.0.1", f"node-{r}", False)
        for r in range(n)
    ]


class Job:
    """What the operator holds of one running job between passes: its stored status (as the API
    server keeps it after a merge patch), its policy state's ConfigMap text and the scrape table."""

    def __init__(self, n: int, ports: Sequence[int], start: float, sample_from: SampleSource = "status") -> None:
        self.spec = job_spec(n)
        self.sample_from = sample_from
        self.pods = job_pods(n)
        # As k8s.observe.endpoints builds them (pod IP + metricsPort), with the child's ports.
        self.endpoints = [
            Endpoint(f"http://127.0.0.1:{port}", pod=pod.name, node=pod.node)
            for port, pod in zip(ports, self.pods, strict=True)
        ]
        status = SGDJobStatus(phase=Phase.RUNNING, start_time=rfc3339(start), replicas=n, ready_replicas=n)
        self.raw_status: dict[str, Any] = pruned(dump_status(status))
        self.policy_text: str | None = None
        self.failing_since: dict[str, float] = {}


@dataclass(frozen=True, slots=True)
class PassCost:
    """One pass: CPU seconds per phase, the scrape's wall seconds, and what the pass did."""

    scrape: float
    policy: float
    push: float
    status: float
    scrape_wall: float
    evaluated: bool
    decision: str
    pushed: bool
    errors: int
    status_changed: bool
    policy_state_changed: bool

    @property
    def total(self) -> float:
        return self.scrape + self.policy + self.push + self.status


async def one_pass(job: Job, session: aiohttp.ClientSession, now: float, token: str) -> PassCost:
    """One policy pass of `job` at (virtual) time `now`, as `reconcile` and `monitor` make it."""
    cpu = time.process_time
    c0 = cpu()
    st = load_status(job.raw_status)
    controller(st).policy_state = job.policy_text
    c1 = cpu()
    w1 = time.perf_counter()
    obs = await observe(job.endpoints, now=now, timeout=SCRAPE_TIMEOUT_S, session=session, sample_from=job.sample_from)
    w2 = time.perf_counter()
    c2 = cpu()
    job.failing_since, _late = unanswered(
        obs.errors,
        job.endpoints,
        job.pods,
        job.failing_since,
        now=now,
        grace_s=SCRAPE_GRACE_S,
        quiet=quiet_reason(st, job.spec, job.pods),
    )
    evaluated, decision, command = False, "", None
    if obs.samples and first_pass_wait(job.spec, st, obs) <= 0:
        busy = in_flight(st, job.spec, job.pods)
        step, _problem = evaluate_job(job.spec, st, obs, now, busy)
        record_observation(st, obs, step.health, job.spec)
        outcome = apply_step(st, step, now, job.spec, job.pods)
        command = command_to_push(st, obs)
        evaluated, decision = True, outcome.applied or ("held" if outcome.held else "keep")
    policy_after = take_policy_state(st)
    c3 = cpu()
    if command is not None and obs.control is not None:
        await post_control(obs.control, command, token, timeout=SCRAPE_TIMEOUT_S, session=session)
    c4 = cpu()
    after = pruned(dump_status(st))
    status_changed = after != job.raw_status
    c5 = cpu()
    state_changed = policy_after is not None and policy_after != job.policy_text
    job.raw_status = after
    if policy_after is not None:
        job.policy_text = policy_after
    return PassCost(
        scrape=c2 - c1,
        policy=c3 - c2,
        push=c4 - c3,
        status=(c1 - c0) + (c5 - c4),
        scrape_wall=w2 - w1,
        evaluated=evaluated,
        decision=decision,
        pushed=command is not None,
        errors=len(obs.errors),
        status_changed=status_changed,
        policy_state_changed=state_changed,
    )
