"""Per running job: scrape the workers, record what they report in status, decide
(level-triggered) whether rank 0 must be sent the desired control command, and tell a worker that
does not answer because of an expected moment from one that is at fault.

Everything but `observe` is pure. What the policy decides is the driver's (`policy.driver`, kept
in status by `k8s.actuator`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from sgdjob_operator.api.models import LOSS_BOUND, SGDJobSpec, SGDJobStatus, Straggler
from sgdjob_operator.k8s.in_flight import in_flight
from sgdjob_operator.k8s.status import FINISHED, Event, PodView, controller, workers
from sgdjob_operator.policy.driver import load_state, pending, unanimous_mode
from sgdjob_operator.policy.eta import goal, keep_point, keep_validation, predict
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.workers.scrape import Endpoint, SampleSource, scrape
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.worker_status import TARGET_REACHED, WorkerStatus

SHOWN_DIGITS = 4  # significant digits of the losses and accuracies kubectl get prints
MAX_LISTED_RANKS = 16  # past this, the BATCHES column gives the range


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
    control_status: WorkerStatus | None = None  # rank 0's /status: validation figures, target reached

    @property
    def mode(self) -> str | None:
        """The mode every reporting worker runs, or None while they disagree (a switch under way)."""
        return unanimous_mode(self.samples)


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


async def observe(
    eps: Sequence[Endpoint],
    *,
    now: float,
    timeout: float,
    session: aiohttp.ClientSession,
    sample_from: SampleSource = "status",
) -> Observation:
    """Every endpoint's sample concurrently, one GET /status each (`sample_from`, scrape.py), rank 0's
    document giving its control epoch; from "metrics" (or a trainer older than /status's ownSteps),
    rank 0's /status is a request of its own after the scrape."""
    results = await scrape(eps, timeout=timeout, session=session, clock=lambda: now, sample_from=sample_from)
    samples = tuple(r.sample for r in results if r.sample is not None)
    errors = {r.endpoint.url: r.error for r in results if r.error}
    rank0 = next((r for r in results if r.sample is not None and r.sample.rank == 0), None)
    control = rank0.endpoint if rank0 is not None else None
    control_status = rank0.status if rank0 is not None else None
    if control is not None and control_status is None:
        (status,) = await scrape(
            [control], metrics=False, status=True, timeout=timeout, session=session, clock=lambda: now
        )
        control_status = status.status
    epoch = control_status.control_epoch if control_status is not None else None
    job_step = control_status.step if control_status is not None else None
    return Observation(now, samples, errors, control, epoch, job_step, control_status)


def shown(value: float, digits: int = SHOWN_DIGITS) -> float:
    """`value` clamped to the status bounds and rounded to `digits` significant digits: what `kubectl
    get` prints is read by a person (0.3183, not 0.31834566593170166); the workers' /metrics keep
    every digit."""
    value = max(-LOSS_BOUND, min(LOSS_BOUND, value))
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def batches_column(batches: Mapping[int, int]) -> str | None:
    """The BATCHES column: per-rank batch sizes while they differ (None when every rank has the same)."""
    if len(set(batches.values())) <= 1:
        return None
    if len(batches) <= MAX_LISTED_RANKS:
        return "/".join(str(batches[r]) for r in sorted(batches))
    return f"{min(batches.values())}..{max(batches.values())} over {len(batches)} ranks"


def record_eta(st: SGDJobStatus, spec: SGDJobSpec, obs: Observation) -> None:
    """Keep the pace and validation points in status and predict the time left from them."""
    ctl, target, rank0 = controller(st), spec.training.target, obs.control_status
    points = keep_point([(p[0], int(p[1])) for p in ctl.progress], obs.time, st.step)
    validations = [(int(v[0]), v[1]) for v in ctl.validations]
    if target is not None and rank0 is not None:
        validations = keep_validation(
            validations,
            target,
            rank0.validation_step,
            rank0.validation_loss,
            rank0.validation_accuracy,
            rank0.validation_metric,
        )
    ctl.progress = [[t, float(s)] for t, s in points]
    ctl.validations = [[float(s), v] for s, v in validations]
    eta = predict(points, spec.training.steps, validations, goal(target) if target else None)
    st.eta, st.eta_seconds, st.eta_basis = (eta.text, round(eta.seconds, 1), eta.basis) if eta else (None, None, None)


def record_observation(
    st: SGDJobStatus, obs: Observation, health: Any | None, spec: SGDJobSpec | None = None
) -> list[Event]:
    """Progress fields from the workers (and the policy's health when it ran; the ETA when `spec` is given)."""
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
        st.loss = shown(losses[0]) if losses else st.loss
        st.batches = batches_column({s.rank: s.batch_size for s in obs.samples})
    st.mode_summary = f"{st.mode} (rebalanced)" if st.mode is not None and st.batches else st.mode
    rank0 = obs.control_status
    if rank0 is not None:
        if rank0.validation_loss is not None:
            st.validation_loss = shown(rank0.validation_loss)
        if rank0.validation_accuracy is not None:
            st.validation_accuracy = shown(max(0.0, min(1.0, rank0.validation_accuracy)))
        if rank0.validation_metric is not None:
            st.validation_metric = shown(rank0.validation_metric)
        if rank0.target_step is not None and st.target_step is None:
            # Kept: the workers exit soon after, and the pods alone do not say why they succeeded.
            st.target_step = rank0.target_step
            st.time_to_target_seconds = max(0.0, min(1e9, rank0.time_to_target_s or 0.0))
            events.append(Event("Normal", TARGET_REACHED, f"validation reached the target at step {st.target_step}"))
        events += checkpoint_failures(st, rank0)
    if spec is not None and obs.samples:
        record_eta(st, spec, obs)
    if health is not None:
        st.throughput = round(float(health.throughput), 3) if health.throughput else st.throughput
        st.stragglers = [Straggler.model_validate(r) for r in health.straggler_records()]
        st.straggler_count = len(st.stragglers)
    return events


def checkpoint_failures(st: SGDJobStatus, rank0: WorkerStatus) -> list[Event]:
    """A Warning for rank 0's checkpoint writes that failed since the last one reported (a full or
    read-only volume): training goes on, but a restart would go back to the last good checkpoint."""
    ckpt, ctl = rank0.checkpoint, controller(st)
    if ckpt is None or ckpt.failed == ctl.checkpoint_failures:
        return []
    # Fewer than reported: a new life of rank 0 counts from 0 again.
    new = ckpt.failed - ctl.checkpoint_failures if ckpt.failed > ctl.checkpoint_failures else ckpt.failed
    ctl.checkpoint_failures = ckpt.failed
    if new <= 0:
        return []
    good = f"step {ckpt.completed[-1]}" if ckpt.completed else "none written by this life"
    return [
        Event(
            "Warning",
            "CheckpointFailed",
            f"{new} checkpoint write(s) failed ({ckpt.failed} since rank 0 started); last, of step "
            f"{ckpt.last_error_step}: {ckpt.last_error}; training goes on, the last good checkpoint: {good}; "
            "check the volume of spec.training.checkpoint.dir",
        )
    ]


def command_to_push(st: SGDJobStatus, obs: Observation) -> ControlCommand | None:
    """The stored command while rank 0 has not applied it (see `policy.driver.pending`)."""
    if obs.control is None:
        return None
    state, _ = load_state(None, controller(st).command, st.mode)
    return pending(state, obs.control_epoch, obs.mode)


def quiet_reason(st: SGDJobStatus, spec: SGDJobSpec, pods: Sequence[PodView]) -> str:
    """Why workers not answering a scrape is expected now ('' when it is not): the job is
    finishing (a worker already exited, the target is reached) or a change is under way (pods not
    ready or terminating, a mode switch's pause)."""
    if st.phase in FINISHED:
        return f"job {st.phase.value}"
    if any(p.phase in ("Succeeded", "Failed") for p in workers(pods)):
        return "workers exiting"
    if st.target_step is not None:
        return "target reached, workers stopping"
    return in_flight(st, spec, pods)


def unanswered(
    errors: Mapping[str, str],
    eps: Sequence[Endpoint],
    pods: Sequence[PodView],
    failing_since: Mapping[str, float],
    *,
    now: float,
    grace_s: float,
    quiet: str,
) -> tuple[dict[str, float], str]:
    """Which failed scrapes are a fault a person should hear of: a Running, ready pod's endpoint
    that has failed every scrape for `grace_s` or more while nothing made that expected (`quiet`,
    see `quiet_reason`). A trainer that is still importing or in rendezvous, or one that is
    exiting, does not answer either, and is no fault.

    Returns the table to keep for the next pass (endpoint URL -> when its failures in a row
    began; an expected moment starts it over) and the Warning's text ('' when none is due)."""
    if quiet:
        return {}, ""
    by_name = {p.name: p for p in pods}
    kept: dict[str, float] = {}
    late: list[str] = []
    for ep in eps:
        if ep.url not in errors:
            continue
        pod = by_name.get(ep.pod or "")
        if pod is None or pod.deleting or pod.phase != "Running" or not pod.ready:
            continue
        since = kept[ep.url] = failing_since.get(ep.url, now)
        if now - since >= grace_s:
            late.append(f"{ep.url} ({ep.pod}): {errors[ep.url]}")
    if not late:
        return kept, ""
    # No durations in the text: the Event is posted again only when the text changes.
    head = f"{len(late)} of {len(eps)} running workers have not answered /metrics for {grace_s:.0f}s or more: "
    return kept, head + "; ".join(late)
