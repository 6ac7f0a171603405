"""A counting reverse proxy in front of the kube-apiserver, so one client's requests can be told
apart from everyone else's (the apiserver's own `apiserver_request_total` does not say who asked).

The client (the operator under test) is given a kubeconfig whose server is this proxy's plain-HTTP
loopback address; the proxy forwards every request, watches included (streamed chunk by chunk), to
the real apiserver over TLS and counts it by (verb, resource). Loopback only; for benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from pathlib import Path

import aiohttp
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}


def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str]:
    """(verb, resource) the way the apiserver names them: list/watch/get/create/update/patch/delete."""
    parts = [p for p in path.split("/") if p]
    # /api/v1/[namespaces/NS/]RES[/NAME[/SUB]] or /apis/GROUP/VERSION/[namespaces/NS/]RES[/NAME[/SUB]]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else parts
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        rest = rest[2:]
    resource = rest[0] if rest else "/".join(parts) or "/"
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{rest[0]}/{rest[2]}"
    method = method.upper()
    if method == "GET":
        verb = "watch" if query.get("watch") in ("1", "true") else "get" if named else "list"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
    return verb, resource


class CountingProxy:
    """Runs in its own thread with its own event loop; `counts` is read after the measurement."""

    def __init__(self, upstream: str, token: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.token = token  # added to every forwarded request: clients send no credentials over plain HTTP
        self.counts: Counter[tuple[str, str]] = Counter()
        self.port = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="api-proxy", daemon=True)
        self._runner: web.AppRunner | None = None

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self.counts)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts[classify(request.method, request.path, dict(request.query))] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers["Authorization"] = f"Bearer {self.token}"
        body = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        response = web.StreamResponse(status=499)
        try:
            async with session.request(
                request.method,
                self.upstream + request.path_qs,
                headers=headers,
                data=body or None,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            ) as upstream:
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
        except ConnectionResetError:
            pass  # the client hung up (a watch it ended, the operator stopping): nobody is left to answer
        return response

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=False, limit=0), auto_decompress=False
        )
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)  # open watches are cut, not awaited
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> CountingProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the API proxy did not start")
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._runner is not None:
                session = self._runner.app["session"]
                await self._runner.cleanup()
                await session.close()
            # Watches still being relayed: end them here rather than leave them to a stopped loop.
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        if self._thread.is_alive():
            with contextlib.suppress(Exception):  # a proxy that will not close must not keep a plane alive
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=15)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig that sends its holder through this proxy (which adds the credentials)."""
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: proxied\n  cluster:\n    server: http://127.0.0.1:{self.port}\n"
            f"users:\n- name: admin\n  user:\n    token: {self.token}\n"
            "contexts:\n- name: proxied\n  context:\n"
            f"    cluster: proxied\n    user: admin\n    namespace: {namespace}\n"
            "current-context: proxied\n"
        )
        return path
