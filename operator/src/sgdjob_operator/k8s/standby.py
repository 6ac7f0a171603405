"""What a standby replica serves while it waits for the Lease: the liveness endpoint, so that a
healthy standby is not restarted by its probe. kopf serves it once this process leads (the port is
handed over); the admission webhook is served for the process' whole life (k8s/webhook.py)."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlparse

from aiohttp import web

from sgdjob_operator.k8s.settings import OperatorSettings


class Standby:
    def __init__(self, cfg: OperatorSettings, leader: Callable[[], str]) -> None:
        self.cfg, self.leader = cfg, leader
        self.runner: web.AppRunner | None = None

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"role": "standby", "leader": self.leader()})

    async def start(self) -> None:
        if not self.cfg.liveness:
            return
        url = urlparse(self.cfg.liveness)
        app = web.Application()
        app.router.add_get(url.path or "/", self._healthz)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, url.hostname or "0.0.0.0", url.port or 80).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
