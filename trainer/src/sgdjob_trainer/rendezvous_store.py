"""The job's rendezvous store: `python -m sgdjob_trainer.rendezvous_store --host H --port P [--health-port Q]`.

Hosts a c10d TCPStore that torchrun's agents use for their c10d rendezvous (`--rdzv-conf is_host=0`).
It runs in its own small pod so that no worker's loss, worker 0's included, takes the rendezvous
with it. torch is imported only here, when the store actually runs: the operator image has no torch.

Health (`--health-port`): a hung store (its process stopped, or its server thread deadlocked) still
accepts TCP connections, since the kernel completes the handshake into the listen backlog, so a
connection says nothing about whether it serves. With a health port the process also serves HTTP
GET `STORE_HEALTH_PATH` there, answering 200 only after a round trip through the store itself (a
client in this process sets a key and reads it back), else 503 with the reason. A stopped process
answers nothing at all, which its prober (the operator each pass, the kubelet's probes) times out on.
No health port is opened unless asked for: the local runner hands out its ports itself.

Intended size: the operator's probe is `PUT STORE_HEALTH_PATH?nodes=N`, answered as GET is, which
also records N, the worker pods the job wants now, under `INTENDED_NODES_KEY` in the store (written
by the health check's own round trip, when it changed). The agents' rounds complete as soon as that
many joined (sgdjob_trainer.rendezvous_rounds). `&departed=ID,ID` adds agents the operator removed on
purpose to `DEPARTED_AGENTS_KEY` (the newest MAX_DEPARTED kept), so their peers take them off the
rendezvous at once. Anyone who reaches this port can set these, as anyone who reaches the store's port
can set any key: neither is more exposed than the other.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

from sgdjob_trainer.wire.launch_contract import DEPARTED_AGENTS_KEY, INTENDED_NODES_KEY, STORE_HEALTH_PATH

log = logging.getLogger("sgdjob_trainer.rendezvous_store")

HEALTH_KEY = "sgdjob/health"  # the key the health check writes and reads back (no rendezvous uses it)
# How long one health check waits for its round trip (and the check's client for the store): a
# loopback set+get takes well under a millisecond, and the 503 then still reaches a prober that waits
# 2 s (the operator's POD_PROBE_TIMEOUT_S).
ROUND_TRIP_TIMEOUT_S = 1.5
# Departed agents kept in the store: a job removes a few per membership change; their peers read the
# list at every rendezvous sync, and an old entry only names an agent that is gone for good.
MAX_DEPARTED = 64
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class StoreClient(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...


@dataclass(slots=True)
class _Flight:
    """One round trip under way; every request that comes meanwhile waits for its result."""

    started: float
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    reported: bool = False


class StoreHealth:
    """Whether the store serves now: one set+get through a client of it per check.

    A round trip runs in a thread of its own and a check waits for it at most `timeout_s`: against a
    stopped or deadlocked server torch's client calls do not return when their timeout says (they
    block until the server runs again), so the check must not sit in one. At most one round trip is
    under way at a time (requests meanwhile share it), so a server that never returns holds one
    thread, not one per probe. A client that failed is dropped and connected afresh next time: a late
    answer on its connection could be read as the next call's."""

    def __init__(
        self,
        connect: Callable[[], StoreClient],
        timeout_s: float = ROUND_TRIP_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flight: _Flight | None = None
        self._client: StoreClient | None = None  # used only by the one round trip under way
        self._count = 0
        self._healthy: bool | None = None
        self.nodes: int | None = None  # the intended size last told (`tell`)
        self._nodes_written: int | None = None
        self.departed: list[str] = []  # agents removed on purpose, oldest first (`tell`)
        self._departed_written = ""

    def tell(self, nodes: int, departed: Sequence[str] = ()) -> None:
        """Record `nodes` as the job's intended size and `departed` as agents removed on purpose: the
        next round trip writes them into the store."""
        self.nodes = nodes
        new = [a for a in dict.fromkeys(departed) if a not in self.departed]
        if new:
            self.departed = [*self.departed, *new][-MAX_DEPARTED:]

    def _told_unwritten(self) -> bool:
        return self.nodes != self._nodes_written or ",".join(self.departed) != self._departed_written

    def check(self) -> str | None:
        """None when a round trip through the store succeeded just now (and wrote what was told before
        this call), else why not."""
        why = self._check_once()
        if why is None and self._told_unwritten():  # the round trip had begun before the last `tell`
            why = self._check_once()
        return why

    def _check_once(self) -> str | None:
        with self._lock:
            flight = self._flight
            if flight is None:
                flight = self._flight = _Flight(started=self._clock())
                threading.Thread(target=self._round_trip, args=(flight,), name="store-health", daemon=True).start()
        if flight.done.wait(self._timeout_s):
            return flight.error
        waited = self._clock() - flight.started
        with self._lock:
            first, flight.reported = not flight.reported, True
        why = f"a round trip through the store has not returned in {waited:.1f}s"
        if first:
            log.warning("store health: %s", why)
        return why

    def _round_trip(self, flight: _Flight) -> None:
        error: str | None = None
        try:
            if self._client is None:
                self._client = self._connect()
            self._count += 1
            value = str(self._count)
            self._client.set(HEALTH_KEY, value)
            got = self._client.get(HEALTH_KEY)
            if got != value.encode():
                error = f"the store gave back {got[:40]!r} for {value!r}"
            nodes = self.nodes
            if error is None and nodes is not None and nodes != self._nodes_written:
                self._client.set(INTENDED_NODES_KEY, str(nodes))
                self._nodes_written = nodes
                log.info("intended size: %d nodes", nodes)
            departed = ",".join(self.departed)
            if error is None and departed != self._departed_written:
                self._client.set(DEPARTED_AGENTS_KEY, departed)
                self._departed_written = departed
                log.info("departed agents: %s", departed)
        except Exception as err:  # any failure of the store's client is an unhealthy store
            lines = str(err).strip().splitlines()
            error = f"{type(err).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")
        if error is not None:
            self._client = None
        if (error is None) != self._healthy:
            if error is None:
                log.info("store health: a round trip through the store succeeded")
            else:
                log.warning("store health: %s", error)
            self._healthy = error is None
        with self._lock:
            flight.error = error
            self._flight = None
        flight.done.set()


class _HealthServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: StoreHealth) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.health = health
        super().__init__(address, _HealthHandler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: its reverse DNS lookup can stall
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _HealthHandler(BaseHTTPRequestHandler):
    server: _HealthServer
    timeout = 10  # a connection that sends no request does not hold its thread for long

    def do_GET(self) -> None:
        if urlsplit(self.path).path != STORE_HEALTH_PATH:
            self._reply(404, "not found")
            return
        why = self.server.health.check()
        self._reply(200, "ok") if why is None else self._reply(503, why)

    def do_PUT(self) -> None:
        """The operator's probe: GET's answer, `?nodes=N` recorded as the intended size and
        `&departed=ID,ID` as agents removed on purpose."""
        url = urlsplit(self.path)
        if url.path != STORE_HEALTH_PATH:
            self._reply(404, "not found")
            return
        self._discard_body()
        given = parse_qs(url.query).get("nodes", [""])[-1]
        if not given.isdigit() or int(given) < 1:
            self._reply(400, f"nodes={given!r}: give the intended number of nodes, a whole number >= 1")
            return
        departed = [a for a in ",".join(parse_qs(url.query).get("departed", [])).split(",") if a]
        if bad := [a for a in departed if not AGENT_ID.fullmatch(a)]:
            self._reply(400, f"departed={bad[0][:140]!r}: give agent ids (a pod's UID), comma-separated")
            return
        self.server.health.tell(int(given), departed)
        self.do_GET()

    def _discard_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= 65536:
            self.rfile.read(length)

    def _reply(self, code: int, text: str) -> None:
        body = (text + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # probed every few seconds: the check logs its changes of state instead


def health_server(host: str, port: int, health: StoreHealth) -> _HealthServer:
    """The health endpoint's server, bound and listening (not yet serving: `serve_forever` in a thread)."""
    return _HealthServer((host, port), health)


def _client_host(host: str) -> str:
    """Where this process reaches its own store: the address it listens on, loopback for a wildcard."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def serve(host: str, port: int, stop: threading.Event, health_port: int | None = None) -> None:
    """Run the store (and its health endpoint, given a port) until `stop` is set. The store lives as
    long as this frame holds it."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch only where the store runs

    # TCPStore alone listens on every interface; binding the socket ourselves keeps it to the pod IP,
    # so several stores can share one machine whose addresses are loopback ones (as `sgdjob run` has them).
    sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
    health = StoreHealth(
        lambda: TCPStore(_client_host(host), port, is_master=False, timeout=timedelta(seconds=ROUND_TRIP_TIMEOUT_S))
    )
    # Bound before the store starts, so a taken port fails the process at once; served once it runs.
    server = health_server(host, health_port, health) if health_port is not None else None
    # wait_for_workers=False: membership is elastic and nobody knows the world size up front.
    store = TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        timeout=timedelta(seconds=900),
    )
    sock.detach()  # the store owns the descriptor now and closes it itself
    log.info("rendezvous store listening on %s:%d", host, port)
    if server is not None:
        threading.Thread(target=server.serve_forever, name="store-health-http", daemon=True).start()
        log.info("store health on http://%s:%d%s", host, health_port, STORE_HEALTH_PATH)
    try:
        stop.wait()
    finally:
        log.info("rendezvous store stopping")
        if server is not None:
            server.shutdown()
            server.server_close()
        del store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgdjob_trainer.rendezvous_store", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (the pod IP)")
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help=f"serve GET {STORE_HEALTH_PATH} on this port of --host (200: the store answered a round trip "
        "just now; 503: it did not, and why), and PUT ...?nodes=N, which also records the job's intended "
        "size; none by default",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serve(args.host, args.port, stop, args.health_port)


if __name__ == "__main__":
    main()
