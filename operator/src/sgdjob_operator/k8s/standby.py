"""What a standby replica serves while it waits for the Lease: the liveness endpoint (a healthy
standby must not be restarted by its probe) and, where configured, the validating admission webhook
(its Service routes to every replica, so a standby that refused connections would fail admissions).
The webhook's decision is the same pure `review` kopf calls in the leader."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import kopf
from aiohttp import web

from sgdjob_operator.k8s.settings import OperatorSettings
from sgdjob_operator.k8s.webhook import PATH, review


def admission_response(request: dict[str, Any]) -> dict[str, Any]:
    """An AdmissionReview answer shaped as kopf shapes the leader's."""
    req = dict(request.get("request") or {})
    obj, old = req.get("object") or {}, req.get("oldObject")
    answer: dict[str, Any] = {"uid": req.get("uid", ""), "allowed": True}
    try:
        review(obj.get("spec"), (old.get("spec") or {}) if old else None)
    except kopf.AdmissionError as err:
        answer = {**answer, "allowed": False, "status": {"message": str(err), "code": err.code or 500}}
    return {
        "apiVersion": request.get("apiVersion", "admission.k8s.io/v1"),
        "kind": request.get("kind", "AdmissionReview"),
        "response": answer,
    }


class Standby:
    def __init__(self, cfg: OperatorSettings, leader: Callable[[], str]) -> None:
        self.cfg, self.leader = cfg, leader
        self.runners: list[web.AppRunner] = []

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"role": "standby", "leader": self.leader()})

    async def _validate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "not an AdmissionReview"}, status=400)
        return web.json_response(admission_response(body))

    async def _serve(self, app: web.Application, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
        self.runners.append(runner)

    async def start(self) -> None:
        if self.cfg.liveness:
            url = urlparse(self.cfg.liveness)
            app = web.Application()
            app.router.add_get(url.path or "/", self._healthz)
            await self._serve(app, url.hostname or "0.0.0.0", url.port or 80, None)
        if self.cfg.webhook_port and self.cfg.webhook_cert and self.cfg.webhook_key:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(self.cfg.webhook_cert, self.cfg.webhook_key)
            app = web.Application()
            app.router.add_post(PATH, self._validate)
            await self._serve(app, self.cfg.webhook_addr, self.cfg.webhook_port, tls)

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners.clear()
