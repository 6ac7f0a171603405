"""Membership changes without torch's last call (sgdjob_trainer.rendezvous_rounds), on real agents.

Three `python -m sgdjob_trainer.agent` processes share the job's store process (its health port, as
the operator's store pod), told the job's intended size through the operator's own probe
(`store_probe.store_answers(nodes=N)`). The last call (300 s) and the heartbeats (60 s to lapse) are
set so long that torch's rules could not pass the test. A world forms at the intended size at once,
grows when a node joins, and, when the operator removes a node (names its agent departed, then
SIGTERM: its pod deleted), the survivors form the smaller world within seconds, waiting for neither."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous import utils as rdzv_utils
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sgdjob_operator.local.procs import free_port_blocks
from sgdjob_operator.workers.store_probe import store_answers
from sgdjob_trainer import rendezvous_rounds
from sgdjob_trainer.rendezvous_rounds import complete_at, expire_departed, method_name, poll_seconds, register
from sgdjob_trainer.wire.launch_contract import AGENT_KEY_PREFIX, ENV_AGENT_ID

pytestmark = pytest.mark.multiproc

HOST = "127.0.0.1"
LAST_CALL_S = 300
KEEP_ALIVE = (10, 6)  # 60 s for a silent node to count as gone
WORKER = Path(__file__).with_name("rounds_worker.py")


def _state(participants: list[str], **kw: object) -> SimpleNamespace:
    base: dict[str, object] = {"closed": False, "complete": False, "redundancy_list": set(), "wait_list": set()}
    return SimpleNamespace(participants=dict.fromkeys(participants, 0), **{**base, **kw})


def test_a_round_completes_at_the_intended_size_within_min_and_max() -> None:
    settings = SimpleNamespace(min_nodes=1, max_nodes=3)
    assert complete_at(_state(["a", "b"]), "a", settings, 2)
    assert not complete_at(_state(["a", "b"]), "a", settings, 3), "one more is coming"
    assert not complete_at(_state(["a", "b"]), "a", settings, None), "nobody said: torch's last call"
    assert not complete_at(_state(["a", "b"]), "c", settings, 2), "only a participant completes it"
    assert not complete_at(_state(["a", "b"], complete=True), "a", settings, 2)
    assert not complete_at(_state(["a", "b"], closed=True), "a", settings, 2)
    assert not complete_at(_state(["a"]), "a", SimpleNamespace(min_nodes=2, max_nodes=3), 1), "never under min"


def test_a_departed_agent_counts_as_long_silent_and_no_other() -> None:
    a, b, c = (_NodeDesc("127.0.0.1", pid, 0) for pid in (1, 2, 3))  # torch's own node identities
    now = datetime.now(UTC)
    state = _state([], last_heartbeats={a: now, b: now}, wait_list={c})
    state.participants = {a: 0, b: 1}
    assert sorted(expire_departed(state, {"127.0.0.1_2_0", "127.0.0.1_3_0", "10.0.0.9_1_0"}), key=repr) == [b, c]
    assert state.last_heartbeats[a] == now, "the one still wanted keeps its heartbeat"
    assert state.last_heartbeats[b] < now - timedelta(days=365) and state.last_heartbeats[c] < now - timedelta(days=365)
    assert expire_departed(state, set()) == []


def _tell(port: int, nodes: int, departed: tuple[str, ...] = ()) -> bool:
    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await store_answers(session, HOST, port, timeout_s=5.0, nodes=nodes, departed=departed)

    return asyncio.run(go())


def _formed(log: Path) -> list[tuple[int, float]]:
    lines = log.read_text().split("\n") if log.exists() else []
    return [(int(f[1]), float(f[2])) for f in (line.split() for line in lines) if f and f[0] == "formed"]


def _wait_formed(log: Path, size: int, after: float, timeout_s: float, agents: list[subprocess.Popen[bytes]]) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [t for n, t in _formed(log) if n == size and t > after]
        if got:
            return got[0]
        assert all(a.poll() is None for a in agents), "an agent ended early"
        time.sleep(0.2)
    raise AssertionError(f"no world of {size} within {timeout_s} s; worlds formed: {_formed(log)}")


def test_a_waiting_agent_polls_the_store_faster_than_torchs_second_and_only_ours_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two of our handlers (min 2, max 3 nodes) join one round through a real store; the first waits
    # for the second. Every pause torch's executor takes while waiting is recorded: ours poll every
    # poll_seconds(3), never torch's second; outside our handlers torch's own delay is untouched.
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    backend = rendezvous_rounds.register()
    pauses: list[tuple[str, float]] = []
    sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        pauses.append((threading.current_thread().name, seconds))
        sleep(seconds)

    monkeypatch.setattr(rdzv_utils.time, "sleep", recording_sleep)
    reads: list[str] = []
    get_state = C10dRendezvousBackend.get_state

    def recording_get_state(self: C10dRendezvousBackend) -> object:
        reads.append(threading.current_thread().name)
        return get_state(self)

    monkeypatch.setattr(C10dRendezvousBackend, "get_state", recording_get_state)

    def handler() -> RendezvousHandler:
        params = RendezvousParameters(
            backend, f"{HOST}:{store.port}", "poll-test", 2, 3, is_host=False, last_call_timeout=1, join_timeout=60
        )
        return get_rendezvous_handler(params)

    first_done: list[float] = []

    def first() -> None:
        handler().next_rendezvous()
        first_done.append(time.monotonic())

    waiting = threading.Thread(target=first, name="first-agent")
    waiting.start()
    time.sleep(1.5)  # the first agent polls meanwhile
    handler().next_rendezvous()
    joined = time.monotonic()
    waiting.join(30)
    assert first_done, "the first agent never completed the round"
    polls = [s for t, s in pauses if t == "first-agent"]
    poll = poll_seconds(3)
    other = [s for s in polls if s != pytest.approx(poll)]
    assert len(polls) >= 5 and poll < 0.2, polls
    assert len(other) <= 1 and all(s <= 0.3 for s in other), polls  # torch's first-round jitter, 0-0.3 s
    assert first_done[0] - joined < 0.6  # seen within a poll or two (torch: its one-second poll and cache)
    # Each poll reads the store: torch's state holder would serve a second's polls from its cache.
    assert reads.count("first-agent") >= len(polls) - 1, (reads.count("first-agent"), len(polls))
    pauses.clear()
    dyn._delay(seconds=1)  # torch's own callers, outside our handlers' operations: torch's second
    assert pauses[-1][1] == 1
    assert poll_seconds(1000) == 1.0


def test_each_join_writes_the_agents_identity_so_a_re_homed_store_learns_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The store's pod re-homed after its node was lost: the new store is empty. The agent's next round
    # writes its identity there again, so the operator can still name it departed.
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    backend = rendezvous_rounds.register()
    monkeypatch.setenv(ENV_AGENT_ID, "uid-x")
    params = RendezvousParameters(backend, f"{HOST}:{store.port}", "identity-test", 1, 1, is_host=False)
    handler = get_rendezvous_handler(params)
    key = AGENT_KEY_PREFIX + "uid-x"
    try:
        handler.next_rendezvous()
        said = store.get(key).decode()
        assert said == repr(handler._this_node)  # type: ignore[attr-defined]  # torch's node identity
        store.delete_key(key)
        handler.next_rendezvous()
        assert store.check([key]) and store.get(key).decode() == said
    finally:
        handler.shutdown()


def test_worlds_form_at_the_intended_size_and_a_removed_node_costs_seconds(tmp_path: Path) -> None:
    port, health = free_port_blocks(2)
    store = subprocess.Popen(
        [sys.executable, "-m", "sgdjob_trainer.rendezvous_store", "--host", HOST, "--port", str(port),
         "--health-port", str(health)],
        stdout=(tmp_path / "store.txt").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    log, done = tmp_path / "formed.txt", tmp_path / "done"
    conf = f"is_host=0,join_timeout=600,last_call_timeout={LAST_CALL_S},keep_alive_interval={KEEP_ALIVE[0]}," + (
        f"keep_alive_max_attempt={KEEP_ALIVE[1]}"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def agent(name: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "sgdjob_trainer.agent", f"--rdzv-endpoint={HOST}:{port}", "--rdzv-backend=c10d",
               "--rdzv-id=rounds", "--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=5", f"--rdzv-conf={conf}",
               f"--local-addr={HOST}", "--no-python", sys.executable, str(WORKER), str(log), str(done)]  # fmt: skip
        out = (tmp_path / f"{name}.txt").open("wb")
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, ENV_AGENT_ID: f"uid-{name}"})

    agents: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60
        while not _tell(health, 2):  # the operator's probe: the job wants 2 nodes
            assert store.poll() is None and time.monotonic() < deadline, (tmp_path / "store.txt").read_text()
            time.sleep(0.3)
        t0 = time.time()
        agents += [agent("a"), agent("b")]
        _wait_formed(log, 2, t0, 120, agents)  # torch: the last call, 300 s after the second joined

        assert _tell(health, 3)
        t1 = time.time()
        agents.append(agent("c"))
        _wait_formed(log, 3, t1, 120, agents)  # 3 is also max: torch completes it so too

        # The policy removes c: the operator says 2 and names c's agent departed, then deletes its pod.
        assert _tell(health, 2, departed=("uid-c",))
        t2 = time.time()
        agents[2].send_signal(signal.SIGTERM)
        formed = _wait_formed(log, 2, t2, 90, agents[:2])
        print(f"world of 2 again {formed - t2:.1f} s after c's SIGTERM")
        # torch: c's heartbeats lapse (60 s), then the last call (300 s).
        assert formed - t2 < 20, f"{formed - t2:.1f} s from the SIGTERM to the smaller world"
        said = (tmp_path / "a.txt").read_text() + (tmp_path / "b.txt").read_text()
        assert "127.0.0.1_" in said and "removed by the job's controller" in said, said[-3000:]
        assert agents[2].wait(timeout=30) != 0
        done.touch()
        for a in agents[:2]:
            assert a.wait(timeout=60) == 0
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        store.terminate()
        store.wait(timeout=30)
        for name in ("a", "b", "c", "store"):
            if (tmp_path / f"{name}.txt").exists():
                print(f"--- {name}\n" + (tmp_path / f"{name}.txt").read_text()[-2500:])


def test_the_rendezvous_events_name_their_method_without_reading_every_frames_source() -> None:
    """torch's event names come from `inspect.stack()` (the source of every frame, twice an event);
    the agent's registered backend names them from the frame alone, with the same name."""
    register()
    assert dyn.get_method_name is method_name

    def operation() -> tuple[str, str]:
        def record() -> tuple[str, str]:
            return dyn.get_method_name(), method_name(1)

        return record()

    assert operation() == ("operation", "record")
    assert method_name(10_000) == "no_method_name"
