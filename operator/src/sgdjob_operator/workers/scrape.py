"""Scrape trainer processes over HTTP: `/status` (or `/metrics`) into `WorkerSample`s, `/status` into
`WorkerStatus`, and push `/control` commands.

Shared by every shell: the Kubernetes operator scrapes pod IPs, the local runner scrapes loopback
ports. Nothing here assumes local processes. One slow or broken worker never fails a scrape of the
others: each endpoint gets its own timeout and its own error string in its `ScrapeResult`.

A sample comes from one GET /status by default: a JSON document is cheaper to serve and to parse than
the Prometheus text (bench/pass_cost.py measures both), and it carries the status too. A trainer older
than /status's `ownSteps` is read from /metrics instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from sgdjob_operator.policy.samples import GradientSignal, WorkerSample
from sgdjob_trainer.wire import metric_names as wm
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.worker_status import WorkerStatus

# Sample names as the trainer exports them; gradient bytes and training seconds are optional (older
# trainers lack them).
STEPS = wm.sample_name(wm.STEPS)
SAMPLES = wm.sample_name(wm.SAMPLES)
COMPUTE = wm.sample_name(wm.COMPUTE_SECONDS)
COMM_WAIT = wm.sample_name(wm.COMM_WAIT_SECONDS)
REQUIRED = (STEPS, SAMPLES, COMPUTE, COMM_WAIT)

T = TypeVar("T")
SampleSource = Literal["status", "metrics"]

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_CONCURRENCY = 64


class MetricsError(ValueError):
    """A /metrics text that is not a trainer's (unparseable, or required series missing)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One trainer process's HTTP server. `rank` is a hint used only when the metrics carry none."""

    url: str
    pod: str | None = None
    node: str | None = None
    rank: int | None = None

    def path(self, path: str) -> str:
        return self.url.rstrip("/") + path


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """What one endpoint answered: a sample and/or a status, or why not (`error`)."""

    endpoint: Endpoint
    time: float
    sample: WorkerSample | None = None
    status: WorkerStatus | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ControlResult:
    """The answer to a POST /control: HTTP status (0 when no answer) and body or error."""

    status: int
    body: str = ""
    error: str | None = None

    @property
    def accepted(self) -> bool:
        return self.error is None and 200 <= self.status < 300


# ---------------------------------------------------------------- pure parsing


def _series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as err:
        raise MetricsError(f"not Prometheus text: {err}") from err
    return out


def _first(series: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = series.get(name)
    return values[0][1] if values else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def parse_metrics(text: str, *, time: float, endpoint: Endpoint | None = None) -> WorkerSample:
    """Parse one trainer's /metrics text into a WorkerSample taken at `time` (supplied by the caller).

    Rank and node come from `sgdjob_worker_info`, else from the endpoint's hints. Raises MetricsError
    naming what is missing.
    """
    series = _series(text)
    missing = [name for name in REQUIRED if name not in series]
    if missing:
        raise MetricsError(f"missing series: {', '.join(missing)}")
    info = series.get(wm.WORKER_INFO, [])
    labels = info[0][0] if info else {}
    rank: int | None
    try:
        rank = int(labels[wm.LABEL_RANK]) if wm.LABEL_RANK in labels else None
    except ValueError as err:
        raise MetricsError(f"{wm.WORKER_INFO} has a non-integer rank label {labels[wm.LABEL_RANK]!r}") from err
    if rank is None and endpoint is not None:
        rank = endpoint.rank
    if rank is None:
        raise MetricsError(f"no rank: {wm.WORKER_INFO} is missing and the endpoint gives none")
    modes = [lab.get(wm.LABEL_MODE, "") for lab, value in series.get(wm.MODE, []) if value >= 0.5]
    node = labels.get(wm.LABEL_NODE) or (endpoint.node if endpoint else None)
    return WorkerSample(
        rank=rank,
        time=time,
        steps=int(_first(series, STEPS) or 0),
        samples=int(_first(series, SAMPLES) or 0),
        compute_seconds=float(_first(series, COMPUTE) or 0.0),
        comm_wait_seconds=float(_first(series, COMM_WAIT) or 0.0),
        mode=modes[0] if modes else "unknown",
        batch_size=int(_finite(_first(series, wm.BATCH_SIZE)) or 0),
        node=node,
        pod=endpoint.pod if endpoint else None,
        loss=_finite(_first(series, wm.LOSS)),
        staleness=_finite(_first(series, wm.STALENESS)) or 0.0,
        world_size=int(_finite(_first(series, wm.WORLD_SIZE)) or 0),
        gradient_bytes=int(_finite(_first(series, wm.GRADIENT_BYTES)) or 0),
        training_seconds=_training_seconds(_first(series, wm.TRAINING_SECONDS)),
        stalled_seconds=_finite(_first(series, wm.STALLED_SECONDS)),
        computing=None if (c := _finite(_first(series, wm.COMPUTING))) is None else c >= 0.5,
        async_capable=None if (a := _finite(_first(series, wm.ASYNC_CAPABLE))) is None else a >= 0.5,
        hierarchical_capable=None if (h := _finite(_first(series, wm.HIERARCHICAL_CAPABLE))) is None else h >= 0.5,
        adaptive_optimizer=None if (d := _finite(_first(series, wm.ADAPTIVE))) is None else d >= 0.5,
        gradient=gradient_signal(
            _finite(_first(series, wm.GRADIENT_STAT_STEPS)),
            _finite(_first(series, wm.GRADIENT_SQ_NORM)),
            _finite(_first(series, wm.GRADIENT_VARIANCE)),
            _finite(_first(series, wm.GRADIENT_LAG_DOT)),
        ),
    )


def gradient_signal(
    steps: float | None, sq_norm: float | None, variance: float | None, lag_dot: float | None
) -> GradientSignal | None:
    """The gradient statistics when the process has measured any (an older trainer says nothing)."""
    if not steps or sq_norm is None or variance is None:
        return None
    return GradientSignal(int(steps), sq_norm, variance, lag_dot)


def _training_seconds(value: float | None) -> float | None:
    """Absent (an older trainer), NaN (training not begun) or negative: not known."""
    known = _finite(value)
    return known if known is not None and known >= 0 else None


def parse_status(text: str) -> WorkerStatus:
    """Parse one trainer's /status body. Raises MetricsError when it is not a trainer's status."""
    try:
        return WorkerStatus.model_validate(json.loads(text))
    except ValueError as err:  # JSON and validation errors alike
        first = err.errors()[0] if isinstance(err, ValidationError) else None
        reason = f"{'.'.join(str(p) for p in first['loc']) or 'document'}: {first['msg']}" if first else str(err)
        raise MetricsError(f"not a trainer status: {reason}") from err


def sample_from_status(status: WorkerStatus, *, time: float, endpoint: Endpoint | None = None) -> WorkerSample:
    """The same WorkerSample built from a /status document (or a rank report file). Its steps are the
    process's own (`ownSteps`, as `sgdjob_steps_total`); a trainer older than that field gives only the
    job's step (in async, the parameter server's), which `scrape` then reads from /metrics instead."""
    return WorkerSample(
        rank=status.rank,
        time=time,
        steps=status.own_steps if status.own_steps is not None else status.step,
        samples=status.samples,
        compute_seconds=status.compute_seconds,
        comm_wait_seconds=status.comm_wait_seconds,
        mode=status.mode.value if status.mode is not None else "unknown",
        batch_size=status.batch_size,
        node=status.node or (endpoint.node if endpoint else None),
        pod=endpoint.pod if endpoint else None,
        loss=_finite(status.loss),
        staleness=status.staleness,
        world_size=status.world_size,
        gradient_bytes=status.gradient_bytes,
        training_seconds=_training_seconds(status.training_seconds),
        stalled_seconds=_finite(status.stalled_seconds),
        computing=status.computing,
        async_capable=status.async_capable,
        hierarchical_capable=status.hierarchical_capable,
        adaptive_optimizer=status.adaptive_optimizer,
        gradient=gradient_signal(
            status.gradient_stat_steps,
            _finite(status.gradient_sq_norm),
            _finite(status.gradient_variance),
            _finite(status.gradient_lag_dot),
        ),
    )


# ---------------------------------------------------------------- HTTP


async def _get(session: aiohttp.ClientSession, url: str, timeout: float) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise MetricsError(f"HTTP {resp.status} from {url}")
        return body


def _describe(err: BaseException) -> str:
    if isinstance(err, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    text = str(err) or type(err).__name__
    return text if isinstance(err, MetricsError) else f"{type(err).__name__}: {text}"


async def _metrics(session: aiohttp.ClientSession, endpoint: Endpoint, timeout: float, now: float) -> WorkerSample:
    return parse_metrics(await _get(session, endpoint.path("/metrics"), timeout), time=now, endpoint=endpoint)


async def _status(session: aiohttp.ClientSession, endpoint: Endpoint, timeout: float) -> WorkerStatus:
    return parse_status(await _get(session, endpoint.path("/status"), timeout))


async def _settle(coro: Awaitable[T]) -> tuple[T | None, str | None]:
    """The coroutine's value, or why it failed: every failure is reported per endpoint, never raised."""
    try:
        return await coro, None
    except Exception as err:
        return None, _describe(err)


async def _nothing() -> tuple[None, None]:
    return None, None


async def _scrape_one(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    *,
    timeout: float,
    metrics: bool,
    status: bool,
    sample_from: SampleSource,
    clock: Callable[[], float],
    gate: asyncio.Semaphore,
) -> ScrapeResult:
    async with gate:
        now = clock()
        if metrics and sample_from == "status":
            doc, status_error = await _settle(_status(session, endpoint, timeout))
            if doc is not None and doc.own_steps is not None:
                return ScrapeResult(endpoint, now, sample_from_status(doc, time=now, endpoint=endpoint), doc)
            if status_error == "timed out":  # /metrics would wait as long again
                return ScrapeResult(endpoint, now, error=f"/status: {status_error}")
            # An older trainer (no ownSteps), or one whose /status failed: its sample from /metrics.
            sample, metrics_error = await _settle(_metrics(session, endpoint, timeout, now))
            errors = [f"{path}: {err}" for path, err in (("/status", status_error), ("/metrics", metrics_error)) if err]
            return ScrapeResult(endpoint, now, sample, doc, "; ".join(errors) if sample is None else None)
        (sample, metrics_error), (doc, status_error) = await asyncio.gather(
            _settle(_metrics(session, endpoint, timeout, now)) if metrics else _nothing(),
            _settle(_status(session, endpoint, timeout)) if status else _nothing(),
        )
        errors = [f"{path}: {err}" for path, err in (("/metrics", metrics_error), ("/status", status_error)) if err]
        return ScrapeResult(endpoint, now, sample, doc, "; ".join(errors) or None)


async def scrape(
    endpoints: Sequence[Endpoint],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    metrics: bool = True,
    status: bool = False,
    sample_from: SampleSource = "status",
    concurrency: int = DEFAULT_CONCURRENCY,
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.time,
) -> list[ScrapeResult]:
    """Scrape every endpoint concurrently (at most `concurrency` at once); one result per endpoint,
    in order. Never raises for a bad worker: its result carries `error` instead. `metrics`: a sample
    is wanted, read from `sample_from` (from "status", the result carries the status as well);
    `status`: the status is wanted."""
    gate = asyncio.Semaphore(max(1, concurrency))
    own = session is None
    sess = session or aiohttp.ClientSession()
    try:
        return list(
            await asyncio.gather(
                *(
                    _scrape_one(
                        sess,
                        ep,
                        timeout=timeout,
                        metrics=metrics,
                        status=status,
                        sample_from=sample_from,
                        clock=clock,
                        gate=gate,
                    )
                    for ep in endpoints
                )
            )
        )
    finally:
        if own:
            await sess.close()


def scrape_sync(endpoints: Sequence[Endpoint], **kwargs: Any) -> list[ScrapeResult]:
    """`scrape` for callers without an event loop."""
    return asyncio.run(scrape(endpoints, **kwargs))


async def post_control(
    endpoint: Endpoint,
    command: ControlCommand,
    token: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    session: aiohttp.ClientSession | None = None,
) -> ControlResult:
    """POST a ControlCommand to a control-owning trainer (rank 0). Never raises for HTTP trouble."""
    own = session is None
    sess = session or aiohttp.ClientSession()
    try:
        async with sess.post(
            endpoint.path("/control"),
            data=command.model_dump_json(by_alias=True, exclude_none=True),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            return ControlResult(resp.status, await resp.text())
    except Exception as err:
        return ControlResult(0, error=_describe(err))
    finally:
        if own:
            await sess.close()
