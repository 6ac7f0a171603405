"""Leader election over a coordination.k8s.io Lease: the shell around k8s/lease.py.

A standby runs no kopf at all (no watches, no handlers, no kopf annotations written), only its
liveness endpoint (k8s/standby.py; the admission webhook is served in every role), and polls the Lease
every retry period. Once it holds the Lease it starts kopf and renews every retry period. A leader
that has not renewed for renewDeadline exits the process at once (a watchdog thread, so a stalled
event loop cannot delay it): the kubelet restarts it as a standby. It never "steps down" while
still running, which is what makes "exactly one active" hold. A clean stop (SIGTERM) hands the
Lease back so a standby takes over on its next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from sgdjob_operator.k8s import lease as core
from sgdjob_operator.k8s import metrics
from sgdjob_operator.k8s.client import ApiError, Credentials, Kube
from sgdjob_operator.k8s.settings import OperatorSettings

log = logging.getLogger("sgdjob_operator.election")
LOST_EXIT_CODE = 3


def identity(pod_name: str | None = None) -> str:
    """Unique per process: a restarted container waits out its own old lease instead of assuming
    the previous process (perhaps still running on a partitioned node) is gone."""
    host = pod_name or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{host}_{uuid.uuid4().hex[:8]}"


class Elector:
    def __init__(self, kube: Kube, *, name: str, namespace: str, me: str, timings: core.Timings) -> None:
        self.kube, self.name, self.namespace, self.me, self.timings = kube, name, namespace, me, timings
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.path = f"{self.collection}/{name}"
        self.lease: dict[str, Any] | None = None
        self.renewed_at = 0.0  # monotonic time the last successful write was sent
        self.leader = ""  # the holder last seen, for the standby's health answer
        self._stop = threading.Event()

    async def acquire(self) -> None:
        """Return once this process holds the Lease."""
        seen: core.Seen | None = None
        log.info("leader election: %s waits for lease %s/%s", self.me, self.namespace, self.name)
        while True:
            try:
                current = await self.kube.get(self.path)
                seen = core.observe(seen, current, time.monotonic(), self.timings.lease_duration_s)
                self.leader = seen.holder
                if core.may_acquire(seen, self.me, time.monotonic()) and await self._take(current):
                    log.info("leader election: %s holds lease %s/%s", self.me, self.namespace, self.name)
                    return
            except ApiError as err:
                log.warning("leader election: cannot read or take the lease: %s", err)
            await asyncio.sleep(self.timings.retry_period_s)

    async def _take(self, current: dict[str, Any] | None) -> bool:
        sent = time.monotonic()
        body = core.acquired(
            current,
            name=self.name,
            namespace=self.namespace,
            me=self.me,
            duration_s=self.timings.lease_duration_s,
            wall=time.time(),
        )
        if current is None:
            status, written = await self.kube.request("POST", self.collection, body, ok=(409,))
        else:
            status, written = await self.kube.request("PUT", self.path, body, ok=(409,))
        if status == 409:
            return False  # someone else wrote first; read again
        self.lease, self.renewed_at = written, sent
        return True

    async def renew_forever(self) -> None:
        """Renew every retry period; a Lease now held by another process ends this one."""
        while True:
            await asyncio.sleep(self.timings.retry_period_s)
            assert self.lease is not None
            sent = time.monotonic()
            try:
                status, written = await self.kube.request(
                    "PUT", self.path, core.renewed(self.lease, time.time()), ok=(409, 404)
                )
                if status < 300:
                    self.lease, self.renewed_at = written, sent
                    continue
                # A write whose answer was lost moved the version; re-read and keep it only if ours.
                current = await self.kube.get(self.path)
                if core.holder(current) != self.me:
                    lost(f"lease {self.namespace}/{self.name} is now held by {core.holder(current) or 'nobody'}")
                self.lease = current
            except ApiError as err:
                log.warning("leader election: renewal failed (deadline %gs): %s", self.timings.renew_deadline_s, err)

    def watchdog(self) -> threading.Thread:
        """A thread, not a task: it must fire even when the event loop is busy or stuck."""

        def run() -> None:
            tick = min(0.5, self.timings.retry_period_s / 4)
            while not self._stop.wait(tick):
                late = time.monotonic() - self.renewed_at
                if late > self.timings.renew_deadline_s:
                    lost(f"no renewal for {late:.1f}s (renew deadline {self.timings.renew_deadline_s:g}s)")

        thread = threading.Thread(target=run, name="lease-watchdog", daemon=True)
        thread.start()
        return thread

    async def release(self) -> None:
        """Hand the Lease back after a clean stop, unless it is no longer ours."""
        self._stop.set()
        if self.lease is None:
            return
        with contextlib.suppress(ApiError):
            status, _ = await self.kube.request("PUT", self.path, core.released(self.lease, time.time()), ok=(409, 404))
            if status < 300:
                log.info("leader election: %s released lease %s/%s", self.me, self.namespace, self.name)


def lost(why: str) -> None:
    """Stop acting now: exit the process without clean-up (nothing may run after the lease is gone;
    state lives in the jobs' status, so nothing is lost)."""
    log.critical("leader election: lost the lease (%s); exiting so a standby can take over", why)
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


def lease_namespace(cfg: OperatorSettings) -> str:
    return cfg.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"


async def run_elected(cfg: OperatorSettings, operator: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Wait as a standby until this process leads, then run `operator` (kopf) while renewing."""
    from sgdjob_operator.k8s.standby import Standby

    timings = core.Timings(cfg.lease_duration_s, cfg.renew_deadline_s, cfg.retry_period_s)
    kube = Kube(Credentials.load(cfg.kubeconfig, cfg.context), timeout_s=timings.retry_period_s * 2)
    elector = Elector(kube, name=cfg.lease_name, namespace=lease_namespace(cfg), me=identity(), timings=timings)
    if cfg.metrics_port:  # so a standby is a healthy scrape target too
        metrics.serve(cfg.metrics_port, cfg.metrics_host)
    metrics.LEADER.set(0)
    standby = Standby(cfg, lambda: elector.leader)
    await standby.start()
    try:
        await elector.acquire()
    finally:
        await standby.stop()  # frees the liveness port kopf's server binds next
    elector.watchdog()
    renewer = asyncio.create_task(elector.renew_forever(), name="lease renewer")
    try:
        await operator()
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        await elector.release()
        await kube.close()
