"""Per running job: scrape the workers, feed the policy, turn its decision into a status change plus
actions, and decide (level-triggered) whether rank 0 must be sent the desired control command.

Everything but `observe` is pure. The desired state lives in status (targetMode, the control
command with its epoch, excluded nodes, the policy's own state), so a restarted operator resumes
from the object, never from memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sgdjob_operator.api.models import LOSS_BOUND, JobMode, SGDJobSpec, SGDJobStatus, Straggler
from sgdjob_operator.k8s.status import Event, PodView, controller, new_command, record_decision, workers
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.workers.scrape import Endpoint, scrape
from sgdjob_trainer.wire.control import ControlCommand

MAX_EXCLUDED = 256


@dataclass(frozen=True, slots=True)
class Observation:
    """One scrape of the job's workers."""

    time: float
    samples: tuple[WorkerSample, ...]
    errors: Mapping[str, str]  # endpoint URL -> why
    control: Endpoint | None = None  # rank 0's server
    control_epoch: int | None = None  # applied epoch rank 0 reports
    # The job's step as rank 0's /status reports it. `sgdjob_steps_total` counts one process's
    # steps since it started, so after a restart that resumed from a checkpoint it is far behind.
    job_step: int | None = None

    @property
    def mode(self) -> str | None:
        """The mode every reporting worker runs, or None while they disagree (a switch under way)."""
        modes = {s.mode for s in self.samples if s.mode != "unknown"}
        return modes.pop() if len(modes) == 1 else None


@dataclass(slots=True)
class Outcome:
    """What applying one decision asks the shell to do, beyond writing status."""

    events: list[Event] = field(default_factory=list)
    scale_to: int | None = None
    delete_pod: str | None = None
    config_changed: bool = False
    applied: str | None = None  # action applied, for metrics
    deferred: str | None = None  # action held back because a change is in flight


def endpoints(spec: SGDJobSpec, pods: Sequence[PodView], *, host: str = "", scheme: str = "http") -> list[Endpoint]:
    """Every trainer process of every running worker: pod IP (or `host`), metricsPort + local rank."""
    out = []
    base = spec.training.metrics_port
    for pod in workers(pods):
        if pod.phase != "Running" or pod.deleting or not (host or pod.ip):
            continue
        for lr in range(spec.nproc_per_node):
            out.append(Endpoint(f"{scheme}://{host or pod.ip}:{base + lr}", pod=pod.name, node=pod.node))
    return out


async def observe(eps: Sequence[Endpoint], *, now: float, timeout: float, session: aiohttp.ClientSession) -> Observation:
    """Scrape /metrics of every endpoint concurrently, then rank 0's /status for its control epoch."""
    results = await scrape(eps, timeout=timeout, session=session, clock=lambda: now)
    samples = tuple(r.sample for r in results if r.sample is not None)
    errors = {r.endpoint.url: r.error for r in results if r.error}
    control = next((r.endpoint for r in results if r.sample is not None and r.sample.rank == 0), None)
    epoch: int | None = None
    job_step: int | None = None
    if control is not None:
        (status,) = await scrape([control], metrics=False, status=True, timeout=timeout, session=session, clock=lambda: now)
        if status.status is not None:
            epoch, job_step = status.status.control_epoch, status.status.step
    return Observation(now, samples, errors, control, epoch, job_step)


def record_observation(st: SGDJobStatus, obs: Observation, health: Any | None) -> list[Event]:
    """Progress fields from the workers (and the policy's health when it ran)."""
    events: list[Event] = []
    mode = obs.mode
    if mode is not None and mode != st.mode:
        if st.mode is not None:
            events.append(Event("Normal", "ModeSwitched", f"workers now run {mode} (was {st.mode})"))
        st.mode = mode
    if obs.samples:
        if obs.job_step is not None:
            st.step = obs.job_step
        else:
            st.step = max(st.step if mode is None else 0, max(s.steps for s in obs.samples))
        losses = [s.loss for s in sorted(obs.samples, key=lambda s: s.rank) if s.loss is not None]
        st.loss = max(-LOSS_BOUND, min(LOSS_BOUND, losses[0])) if losses else st.loss
    if health is not None:
        st.throughput = round(float(health.throughput), 3) if health.throughput else st.throughput
        st.stragglers = [Straggler.model_validate(r) for r in health.straggler_records()]
        st.straggler_count = len(st.stragglers)
    return events


def command_to_push(st: SGDJobStatus, obs: Observation) -> ControlCommand | None:
    """The stored command while rank 0 has not applied its epoch: re-sent every pass until it has
    (the trainer ignores an epoch it has seen, so a re-push is harmless). Without an epoch reading,
    a mode mismatch is the signal."""
    raw = controller(st).command
    if not raw or obs.control is None:
        return None
    command = ControlCommand.model_validate(raw)
    if obs.control_epoch is not None:
        return command if obs.control_epoch < command.epoch else None
    return command if command.mode is not None and obs.mode != command.mode.value else None


def apply_decision(st: SGDJobStatus, spec: SGDJobSpec, decision: Any, rank_pods: Mapping[int, str], *, now: float, busy: str) -> Outcome:
    """Record a policy decision in status and say what else to do. At most one change in flight:
    while `busy` says one is, anything but keep is deferred (the policy asks again next interval)."""
    out = Outcome()
    action = str(getattr(decision, "action", "keep"))
    if action == "keep":
        return out
    if busy:
        out.deferred = action
        return out
    reason = str(decision.reason)
    if action == "switchMode":
        if spec.mode is not JobMode.AUTO:
            out.deferred = action  # the user fixed the mode; the policy may not move it
            return out
        mode = str(decision.mode)
        groups = [list(g) for g in decision.groups] if decision.groups is not None else None
        sizes = {str(r): int(b) for r, b in decision.batch_sizes.items()} if decision.batch_sizes is not None else None
        st.target_mode = mode
        new_command(st, now, reason, carry=False, mode=mode, groups=groups, batchSizes=sizes)
        record_decision(st, now, action, reason, mode=mode)
        out.events.append(Event("Normal", "SwitchMode", f"switching to {mode}: {reason}"))
        out.config_changed = True
    elif action == "rebalance":
        sizes = {str(r): int(b) for r, b in decision.batch_sizes.items()}
        new_command(st, now, reason, carry=True, batchSizes=sizes)
        record_decision(st, now, action, reason)
        out.events.append(Event("Normal", "Rebalance", f"per-rank batch sizes {sizes}: {reason}"))
    elif action == "replaceWorker":
        ctl = controller(st)
        pod = decision.pod or rank_pods.get(int(decision.rank))
        node = decision.exclude_node
        if node:
            ctl.excluded_nodes = [*[n for n in ctl.excluded_nodes if n != node][-(MAX_EXCLUDED - 1) :], node]
        elif pod:
            out.delete_pod = pod
        record_decision(st, now, action, reason, rank=int(decision.rank))
        where = f"; node {node} excluded for this job" if node else ""
        out.events.append(Event("Normal", "ReplaceWorker", f"replacing rank {decision.rank} (pod {pod or 'unknown'}){where}: {reason}"))
        ctl.last_change_time = st.decisions[-1].time
    elif action == "rescale":
        target = max(spec.min_workers, min(spec.max_workers, int(decision.replicas)))
        if target == spec.replicas:
            return out
        out.scale_to = target
        record_decision(st, now, action, reason, replicas=target)
        out.events.append(Event("Normal", "Rescale", f"rescaling {spec.replicas} -> {target} workers: {reason}"))
        controller(st).last_change_time = st.decisions[-1].time
    else:
        return out
    out.applied = action
    return out


def command_fields(st: SGDJobStatus) -> tuple[dict[int, int], list[list[int]] | None]:
    """Per-rank batch sizes and groups in force, from the stored command (for the policy's view)."""
    raw = controller(st).command or {}
    sizes = {int(k): int(v) for k, v in (raw.get("batchSizes") or {}).items()}
    groups = raw.get("groups")
    return sizes, groups if isinstance(groups, list) else None
