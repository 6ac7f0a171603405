"""The rendezvous store's health check, torch-free: `StoreHealth` (one set+get round trip through a
store client per check, bounded by its timeout, one at a time), the HTTP endpoint that serves it, and
the operator's probe of that endpoint (`store_probe.store_answers`: 200 answers, anything else is silence)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp

from sgdjob_operator.workers.store_probe import store_answers
from sgdjob_trainer.rendezvous_store import HEALTH_KEY, MAX_DEPARTED, StoreHealth, health_server
from sgdjob_trainer.wire.launch_contract import DEPARTED_AGENTS_KEY, INTENDED_NODES_KEY, STORE_HEALTH_PATH


class FakeStore:
    def __init__(self, *, fail: bool = False, wrong: bool = False, block: threading.Event | None = None) -> None:
        self.data: dict[str, str] = {}
        self.sets = 0
        self.fail, self.wrong, self.block = fail, wrong, block

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        self.data[key] = value

    def get(self, key: str) -> bytes:
        if self.block is not None:
            self.block.wait()
        if self.fail:
            raise RuntimeError("wait timeout after 1500ms, keys: /sgdjob/health\nmore detail")
        return b"stale" if self.wrong else self.data[key].encode()


class Connector:
    def __init__(self, store: FakeStore) -> None:
        self.store, self.calls = store, 0

    def __call__(self) -> FakeStore:
        self.calls += 1
        return self.store


def test_a_round_trip_is_healthy_and_the_client_is_kept() -> None:
    store = FakeStore()
    connect = Connector(store)
    health = StoreHealth(connect, timeout_s=5)
    assert health.check() is None and health.check() is None
    assert connect.calls == 1 and store.sets == 2 and store.data[HEALTH_KEY] == "2"  # a new value each time


def test_a_failed_round_trip_says_why_and_the_next_check_connects_afresh() -> None:
    store = FakeStore(fail=True)
    connect = Connector(store)
    health = StoreHealth(connect, timeout_s=5)
    why = health.check()
    assert why == "RuntimeError: wait timeout after 1500ms, keys: /sgdjob/health", why  # first line only
    store.fail = False
    assert health.check() is None and connect.calls == 2  # the failed client was dropped


def test_a_store_that_gives_back_another_value_is_unhealthy() -> None:
    health = StoreHealth(Connector(FakeStore(wrong=True)), timeout_s=5)
    why = health.check()
    assert why is not None and "gave back b'stale'" in why


def test_a_connect_that_fails_is_unhealthy() -> None:
    def refuse() -> FakeStore:
        raise ConnectionRefusedError(111, "Connection refused")

    why = StoreHealth(refuse, timeout_s=5).check()
    assert why is not None and why.startswith("ConnectionRefusedError"), why


def test_a_round_trip_that_does_not_return_is_unhealthy_within_the_timeout_and_runs_once() -> None:
    """torch's client calls block until a stopped server runs again: the check answers at its timeout,
    requests meanwhile share the one round trip under way, and once it returns checks are fresh again."""
    release = threading.Event()
    store = FakeStore(block=release)
    connect = Connector(store)
    health = StoreHealth(connect, timeout_s=0.2)
    started = time.monotonic()
    why = health.check()
    assert why is not None and "has not returned" in why
    assert time.monotonic() - started < 2.0
    why = health.check()
    assert why is not None and "has not returned" in why
    assert store.sets == 1 and connect.calls == 1  # no second round trip beside the stuck one
    store.block = None
    release.set()
    deadline = time.monotonic() + 5
    while (why := health.check()) is not None:  # the stuck round trip's own success counts, as it ends now
        assert time.monotonic() < deadline, why
    assert health.check() is None and store.sets == 2  # then a fresh one per check again


class FixedHealth(StoreHealth):
    def __init__(self, why: str | None) -> None:
        super().__init__(Connector(FakeStore()))
        self.why = why

    def check(self) -> str | None:
        return self.why


@contextmanager
def serving(health: StoreHealth) -> Iterator[int]:
    server = health_server("127.0.0.1", 0, health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _answers(port: int, timeout_s: float = 2.0) -> bool:
    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await store_answers(session, "127.0.0.1", port, timeout_s=timeout_s)

    return asyncio.run(go())


def test_the_endpoint_answers_200_or_503_with_the_reason() -> None:
    health = FixedHealth(None)
    with serving(health) as port:
        assert _get(port, STORE_HEALTH_PATH) == (200, "ok\n")
        assert _get(port, "/other")[0] == 404
        assert _answers(port)
        health.why = "RuntimeError: broken"
        assert _get(port, STORE_HEALTH_PATH) == (503, "RuntimeError: broken\n")
        assert not _answers(port)  # 503: the store's own round trip failed


def test_the_operator_takes_a_refused_or_silent_endpoint_for_silence() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert not _answers(port)  # nothing listens: refused
        sock.listen()  # accepts (the kernel completes the handshake) but never answers: a stopped store
        started = time.monotonic()
        assert not _answers(port, timeout_s=0.5)
        assert time.monotonic() - started < 2.0


def _tell(port: int, nodes: int, departed: tuple[str, ...]) -> bool:
    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await store_answers(session, "127.0.0.1", port, timeout_s=5.0, nodes=nodes, departed=departed)

    return asyncio.run(go())


def _put(port: int, query: str) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{STORE_HEALTH_PATH}?{query}", method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_operators_probe_writes_the_intended_size_and_the_departed_agents_before_it_answers() -> None:
    store = FakeStore()
    with serving(StoreHealth(Connector(store), timeout_s=5)) as port:
        assert _tell(port, 3, ())
        assert store.data[INTENDED_NODES_KEY] == "3" and DEPARTED_AGENTS_KEY not in store.data
        assert _tell(port, 2, ("uid-c",))  # a rescale removes c: by the time the probe answers, the store says so
        assert store.data[INTENDED_NODES_KEY] == "2" and store.data[DEPARTED_AGENTS_KEY] == "uid-c"
        assert _tell(port, 2, ("uid-c", "uid-d"))  # told again each pass it deletes: kept once
        assert store.data[DEPARTED_AGENTS_KEY] == "uid-c,uid-d"
        code, text = _put(port, "nodes=2&departed=uid-e,../etc")
        assert code == 400 and "departed='../etc'" in text and "pod's UID" in text
        assert store.data[DEPARTED_AGENTS_KEY] == "uid-c,uid-d", "a refused probe changes nothing"
        ids = tuple(f"uid-{i}" for i in range(MAX_DEPARTED + 5))
        assert _tell(port, 2, ids)
        kept = store.data[DEPARTED_AGENTS_KEY].split(",")
        assert len(kept) == MAX_DEPARTED and kept[-1] == ids[-1], "the newest are kept"
