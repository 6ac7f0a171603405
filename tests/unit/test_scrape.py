"""Scraping trainer endpoints: parsing real prometheus_client output, per-endpoint errors and
timeouts against real HTTP servers, and pushing control commands."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from sgdjob_operator.workers.scrape import (
    Endpoint,
    MetricsError,
    parse_metrics,
    parse_status,
    post_control,
    sample_from_status,
    scrape,
    scrape_sync,
)
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire import metric_names as wm
from sgdjob_trainer.wire.control import ControlCommand


def trainer_telemetry(
    rank: int = 2,
    node: str = "node-a",
    mode: SyncMode = SyncMode.HIERARCHICAL,
    steps: int = 40,
    loss: float = 0.25,
) -> Telemetry:
    """A trainer's own Telemetry after `steps` steps of 32 samples (2.5 s compute, 0.75 s wait in all)."""
    info = WorldInfo(rank, local_rank=0, world_size=4, local_world_size=1, group_rank=0, restart_count=0, node=node)
    telemetry = Telemetry(info, mode, batch_size=32)
    telemetry.set_gradient_bytes(4096)
    for step in range(1, steps + 1):
        telemetry.record_step(step, 32, 2.5 / steps, 0.75 / steps, 0.08, loss, 1.5)
    return telemetry


def trainer_metrics(rank: int = 2, node: str = "node-a", loss: float = 0.25, info: bool = True) -> str:
    """What a trainer exports on /metrics, rendered by the trainer's Telemetry."""
    telemetry = trainer_telemetry(rank=rank, node=node, loss=loss)
    if not info:
        telemetry.registry.unregister(telemetry.m_info)
    return telemetry.render_metrics().decode()


def test_parse_metrics_reads_every_field() -> None:
    ep = Endpoint("http://10.0.0.7:9400", pod="job-worker-1", node="hint-node", rank=9)
    sample = parse_metrics(trainer_metrics(), time=123.0, endpoint=ep)
    assert (sample.rank, sample.node, sample.pod, sample.time) == (2, "node-a", "job-worker-1", 123.0)
    assert (sample.steps, sample.samples, sample.batch_size, sample.world_size) == (40, 1280, 32, 4)
    assert sample.compute_seconds == pytest.approx(2.5)
    assert sample.comm_wait_seconds == pytest.approx(0.75)
    assert sample.mode == "hierarchical"
    assert sample.loss == pytest.approx(0.25)
    assert sample.staleness == pytest.approx(1.5) and sample.gradient_bytes == 4096


def test_parse_metrics_falls_back_to_endpoint_hints_and_drops_nan_loss() -> None:
    text = trainer_metrics(info=False, loss=float("nan"))
    sample = parse_metrics(text, time=1.0, endpoint=Endpoint("http://x:1", rank=5, node="n5"))
    assert (sample.rank, sample.node, sample.loss) == (5, "n5", None)
    with pytest.raises(MetricsError, match="no rank"):
        parse_metrics(text, time=1.0)


def test_parse_metrics_reads_training_seconds_only_once_training_began() -> None:
    telemetry = trainer_telemetry()
    assert parse_metrics(telemetry.render_metrics().decode(), time=1.0).training_seconds is None  # NaN: not begun
    telemetry.begin_training()
    text = telemetry.render_metrics().decode()
    trained = parse_metrics(text, time=1.0).training_seconds
    assert trained is not None and 0.0 <= trained <= telemetry.training_seconds()
    # An older trainer without the series, or a value that cannot be a duration: not known.
    older = "\n".join(line for line in text.splitlines() if wm.TRAINING_SECONDS not in line) + "\n"
    assert parse_metrics(older, time=1.0).training_seconds is None
    negative = older + f"# TYPE {wm.TRAINING_SECONDS} gauge\n{wm.TRAINING_SECONDS} -3.0\n"
    assert parse_metrics(negative, time=1.0).training_seconds is None


def test_parse_metrics_names_missing_series() -> None:
    reg = CollectorRegistry()
    Counter(wm.STEPS, "steps", registry=reg).inc(1)
    with pytest.raises(MetricsError, match=wm.sample_name(wm.SAMPLES)):
        parse_metrics(generate_latest(reg).decode(), time=0.0, endpoint=Endpoint("http://x:1", rank=0))
    with pytest.raises(MetricsError):
        parse_metrics("this is { not prometheus", time=0.0)


def test_sample_from_status_matches_the_metrics_view() -> None:
    telemetry = trainer_telemetry()
    ep = Endpoint("http://10.0.0.7:9400", pod="job-worker-1")
    from_metrics = parse_metrics(telemetry.render_metrics().decode(), time=123.0, endpoint=ep)
    from_status = sample_from_status(telemetry.status(), time=123.0, endpoint=ep)
    # Seconds since the last step are read at each answer: equal up to the time between the two.
    assert from_status.stalled_seconds is not None and from_metrics.stalled_seconds is not None
    unclocked = {"stalled_seconds": None, "training_seconds": None}
    assert dataclasses.replace(from_status, **unclocked) == dataclasses.replace(from_metrics, **unclocked)
    for not_a_status in ('{"step": 1}', "[1, 2]", "{{{", '{"rank": 0, "mode": "sideways"}'):
        with pytest.raises(MetricsError, match="not a trainer status"):
            parse_status(not_a_status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serve(routes: dict[tuple[str, str], Handler]) -> AsyncIterator[str]:
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def worker_routes(rank: int, hold: asyncio.Event | None = None) -> dict[tuple[str, str], Handler]:
    """A worker's two GET routes; with `hold`, every answer waits until the event is set."""

    async def metrics(_: web.Request) -> web.Response:
        if hold is not None:
            await hold.wait()
        return web.Response(text=trainer_metrics(rank=rank, node=f"n{rank}"))

    async def status(_: web.Request) -> web.Response:
        if hold is not None:
            await hold.wait()
        return web.json_response({"rank": rank, "step": 7, "mode": "sync"})

    return {("GET", "/metrics"): metrics, ("GET", "/status"): status}


def test_scrape_reports_each_bad_worker_without_failing_the_rest() -> None:
    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="{{{ not metrics")

    async def error(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def main() -> None:
        hold = asyncio.Event()
        async with (
            serve(worker_routes(0)) as good0,
            serve(worker_routes(1)) as good1,
            serve(worker_routes(2, hold)) as slow,
            serve({("GET", "/metrics"): garbage, ("GET", "/status"): error}) as bad,
        ):
            closed = Endpoint("http://127.0.0.1:9")  # discard port: nothing listens
            eps = [Endpoint(good0), Endpoint(slow), Endpoint(bad), closed, Endpoint(good1)]
            started = time.monotonic()
            results = await scrape(eps, timeout=1.0, status=True, clock=lambda: 42.0)
            elapsed = time.monotonic() - started
            hold.set()
        assert [r.endpoint for r in results] == eps
        assert elapsed < 4.0, "endpoints must be scraped concurrently with their own timeout"
        ok0, slow_r, bad_r, closed_r, ok1 = results
        assert ok0.ok and ok0.sample is not None and ok0.sample.rank == 0 and ok0.sample.time == 42.0
        assert ok0.status is not None and ok0.status.document() == {"rank": 0, "step": 7, "mode": "sync"}
        assert ok1.ok and ok1.sample is not None and ok1.sample.node == "n1"
        assert slow_r.sample is None and slow_r.error is not None and "timed out" in slow_r.error
        assert bad_r.error is not None and "/metrics: not Prometheus text" in bad_r.error and "HTTP 500" in bad_r.error
        assert closed_r.error is not None and closed_r.sample is None and not closed_r.ok

    asyncio.run(main())


def test_one_get_of_status_gives_a_workers_sample_and_an_older_trainer_is_read_from_metrics() -> None:
    """The operator's pass asks each worker once: /status carries the process's own steps and its
    training seconds, so the sample is the one /metrics gives (the job's step, in async the servers',
    is not the worker's pace). A trainer without ownSteps in /status is read from /metrics."""
    telemetry = trainer_telemetry()
    telemetry.begin_training()
    telemetry.set_step(1000)  # the job's step, far from this process's 40 own steps
    asked: list[str] = []

    def routes(old: bool) -> dict[tuple[str, str], Handler]:
        async def metrics(request: web.Request) -> web.Response:
            asked.append(request.path)
            return web.Response(body=telemetry.render_metrics(), content_type="text/plain")

        async def status(request: web.Request) -> web.Response:
            asked.append(request.path)
            doc = telemetry.status().document()
            return web.json_response({k: v for k, v in doc.items() if k != "ownSteps"} if old else doc)

        return {("GET", "/metrics"): metrics, ("GET", "/status"): status}

    async def main() -> None:
        async with serve(routes(old=False)) as new, serve(routes(old=True)) as old:
            [fresh] = await scrape([Endpoint(new)], timeout=2.0, clock=lambda: 5.0)
            assert asked == ["/status"]
            [before] = await scrape([Endpoint(old)], timeout=2.0, clock=lambda: 5.0)
            assert asked == ["/status", "/status", "/metrics"]
            [metrics] = await scrape([Endpoint(new)], timeout=2.0, clock=lambda: 5.0, sample_from="metrics")
            assert asked[3:] == ["/metrics"]
        assert fresh.ok and fresh.sample is not None and fresh.status is not None and fresh.status.step == 1000
        assert before.ok and before.sample is not None and before.status is not None and metrics.sample is not None
        assert fresh.sample.steps == before.sample.steps == metrics.sample.steps == 40
        assert fresh.sample.training_seconds is not None and fresh.sample.training_seconds >= 0
        clocked = {"stalled_seconds": None, "training_seconds": None}
        assert dataclasses.replace(fresh.sample, **clocked) == dataclasses.replace(metrics.sample, **clocked)

    asyncio.run(main())


def test_scrape_sync_without_a_loop() -> None:
    assert scrape_sync([Endpoint("http://127.0.0.1:9")], timeout=0.5)[0].error


def test_post_control_sends_the_token_and_the_command() -> None:
    seen: list[tuple[str | None, dict[str, object]]] = []

    async def control(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        if auth != "Bearer s3cret":
            return web.Response(status=401)
        seen.append((auth, json.loads(await request.text())))
        return web.json_response({"accepted": True}, status=202)

    async def main() -> None:
        async with serve({("POST", "/control"): control}) as url:
            cmd = ControlCommand(epoch=3, mode="async", batch_sizes={3: 16}, reason="rank 3 is 3x slower")
            ok = await post_control(Endpoint(url), cmd, "s3cret")
            denied = await post_control(Endpoint(url), cmd, "wrong")
        unreachable = await post_control(Endpoint("http://127.0.0.1:9"), cmd, "s3cret", timeout=0.5)
        assert ok.accepted and ok.status == 202
        assert not denied.accepted and denied.status == 401
        assert not unreachable.accepted and unreachable.status == 0 and unreachable.error
        assert seen == [
            ("Bearer s3cret", {"epoch": 3, "mode": "async", "batchSizes": {"3": 16}, "reason": "rank 3 is 3x slower"})
        ]
        assert ControlCommand.model_validate(seen[0][1]) == cmd

    asyncio.run(main())
