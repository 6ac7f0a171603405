"""The rendezvous store process: `python -m sgdjob_trainer.rendezvous_store` serves a c10d TCPStore on the
address it is given (only there, so several jobs' stores can share a machine) and stops on SIGTERM; with
--health-port it serves GET /healthz, which the operator's probe reads, and a stopped store fails."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from sgdjob_operator.workers.store_probe import POD_PROBE_TIMEOUT_S, store_answers

torch_distributed = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.multiproc


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def test_store_serves_clients_on_its_address_and_stops_on_sigterm() -> None:
    host = "127.0.0.77"
    port = _free_port(host)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sgdjob_trainer.rendezvous_store", "--host", host, "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "store did not start listening"
                time.sleep(0.2)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # bound to its own address only
        client = torch_distributed.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
        client.set("rdzv/state", "round-1")
        other = torch_distributed.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
        assert other.get("rdzv/state") == b"round-1"
        assert other.compare_set("rdzv/state", "round-1", "round-2") == b"round-2"  # what c10d rendezvous relies on
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _answers(host: str, port: int) -> bool:
    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await store_answers(session, host, port)

    return asyncio.run(go())


def test_a_stopped_store_still_accepts_connections_but_fails_the_operators_health_probe() -> None:
    """The gap a TCP connect leaves: SIGSTOPped, the store's process serves nothing, yet the kernel still
    completes connections into its listen backlog. Its health endpoint answers nothing then, and the
    operator's probe reports it silent within its timeout; once continued, it answers again."""
    host = "127.0.0.79"
    port, health_port = _free_port(host), _free_port(host)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "sgdjob_trainer.rendezvous_store", "--host", host),
            *("--port", str(port), "--health-port", str(health_port)),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _answers(host, health_port):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the store's health endpoint never answered 200"
            time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        assert not _answers(host, health_port), "a stopped store answered its health check"
        took = time.monotonic() - started
        assert took <= POD_PROBE_TIMEOUT_S + 1.0, took
        socket.create_connection((host, port), timeout=1).close()  # what the old probe saw: it accepts
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not _answers(host, health_port):
            assert time.monotonic() < deadline, "the continued store did not answer its health check again"
            time.sleep(0.2)
        # The store itself serves the agents as before.
        client = torch_distributed.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
        client.set("rdzv/state", "round-1")
        assert client.get("rdzv/state") == b"round-1"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


HELLO = """
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} world {dist.get_world_size()}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_torchrun_agents_rendezvous_through_the_store(tmp_path: Path) -> None:
    """Two torchrun agents configured exactly as the operator's pods are (PET_* env, is_host=0,
    PET_LOCAL_ADDR) form one world through the dedicated store."""
    host = "127.0.0.80"
    port = _free_port(host)
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    store = subprocess.Popen(
        [sys.executable, "-m", "sgdjob_trainer.rendezvous_store", "--host", host, "--port", str(port)],
        stderr=subprocess.DEVNULL,
    )
    agents: list[subprocess.Popen[str]] = []
    try:
        for i in range(2):
            env = {
                **os.environ,
                "PET_NNODES": "1:2",
                "PET_NPROC_PER_NODE": "1",
                "PET_RDZV_BACKEND": "c10d",
                "PET_RDZV_ENDPOINT": f"{host}:{port}",
                "PET_RDZV_ID": "job-uid",
                "PET_RDZV_CONF": "is_host=0",
                "PET_LOCAL_ADDR": f"127.0.0.{81 + i}",
                "PET_MAX_RESTARTS": "3",
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
            }
            agents.append(
                subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", str(script)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
        assert [a.returncode for a in agents] == [0, 0], outputs
        assert sorted(line for out in outputs for line in out.splitlines() if line.startswith("rank ")) == [
            "rank 0 world 2",
            "rank 1 world 2",
        ]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)
        store.send_signal(signal.SIGTERM)
        store.wait(timeout=30)
