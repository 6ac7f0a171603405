"""A TLS reverse proxy in front of the kube-apiserver that records every request as the RBAC
authorizer names it: (apiGroup, resource[/subresource], verb) and the answer's status.

It serves the API server's own certificate and key (the devcluster plane's self-signed `apiserver.crt`, which
is also the CA in every service-account token Secret), so a pod whose in-cluster config points at
this proxy (`KUBERNETES_SERVICE_PORT`) verifies it as the API server and needs no change at all.
Requests pass through with the client's own bearer token, so the API server authorizes them as the
pod's ServiceAccount: a missing RBAC rule shows up here as a 403. Loopback only; for tests.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}


@dataclass(frozen=True)
class Call:
    group: str
    resource: str
    verb: str
    status: int
    path: str


def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str] | None:
    """(apiGroup, resource, verb) of a resource request; None for discovery and other non-resource URLs."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]  # namespaced: namespaces/NS/RES...
    if not rest:
        return None
    resource = rest[0] if len(rest) < 3 else f"{rest[0]}/{rest[2]}"
    named = len(rest) >= 2
    method = method.upper()
    if method == "GET":
        verb = "watch" if query.get("watch") in ("1", "true") else "get" if named else "list"
    else:
        verb = {
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if named else "deletecollection",
        }[method]
    return group, resource, verb


@dataclass
class RecordingProxy:
    upstream: str  # https://127.0.0.1:PORT
    cert: Path
    key: Path
    port: int
    calls: list[Call] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    def permissions(self) -> set[tuple[str, str, str]]:
        return {(c.group, c.resource, c.verb) for c in list(self.calls)}

    def denied(self) -> list[Call]:
        return [c for c in list(self.calls) if c.status in (401, 403)]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        body = await request.read()
        async with self._session.request(
            request.method, URL(self.upstream + request.raw_path, encoded=True), headers=headers, data=body or None
        ) as upstream:
            kind = classify(request.method, request.path, dict(request.query))
            if kind is not None:
                self.calls.append(Call(*kind, status=upstream.status, path=request.path))
            response = web.StreamResponse(
                status=upstream.status, headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
            )
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except (ConnectionResetError, aiohttp.ClientError, asyncio.CancelledError):
                pass  # a watch the client (or the stop) ended
            return response

    async def _start(self) -> None:
        client_ctx = ssl.create_default_context(cafile=str(self.cert))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=client_ctx, limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(str(self.cert), str(self.key))
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=server_ctx).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def start(self) -> RecordingProxy:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="recording-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise TimeoutError("recording proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None
