"""The processes of one real-node cluster (devcluster/realnodes.py), by name ("etcd", "node-0.kubelet"):
started in a session of their own with a log file each, waited on, stopped only while still ours, and
swept out of the cluster's network namespaces.

Every pid is recorded (`on_change`: the cluster writes its state.json) as soon as its daemon starts, so
a later `down` can stop whatever a crashed run left; the binary's name beside it tells our pid from a
reused one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from devcluster import realnet
from devcluster.kube import KubeError
from devcluster.proctree import alive

DAEMON_NICE = 19
NICE = ["nice", "-n", str(DAEMON_NICE)]


class Daemons:
    """Name -> pid and binary of every daemon started (kept in the cluster's state), and the Popen of
    those this process started (polled: one that exits while `wait` waits is a crash)."""

    def __init__(self, workdir: Path, logs: Path, on_change: Callable[[], None]) -> None:
        self.workdir = workdir
        self.logs = logs
        self.on_change = on_change
        self.pids: dict[str, int] = {}
        self.cmds: dict[str, str] = {}  # name -> the binary, to tell our pid from a reused one
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str], prefix: list[str]) -> int:
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(
                [*prefix, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )
        finally:
            out.close()
        # nsenter and nice exec the next program: this pid is the daemon's own.
        self.procs[name], self.pids[name], self.cmds[name] = proc, proc.pid, Path(argv[0]).name
        self.on_change()
        return proc.pid

    def wait(self, check: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    log_tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode} waiting for {what}:\n{log_tail}")
            try:
                if check():
                    return
            except (KubeError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {self.logs}")

    def terminate(self, names: list[str], grace: float) -> None:
        """SIGTERM to each (still ours) process, then SIGKILL whatever is alive after `grace` seconds."""
        pids = [self.pids[n] for n in names if n in self.pids and self._ours(n)]
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.1)
        for pid in pids:
            if alive(pid):
                _signal(pid, signal.SIGKILL)
        self.reap()

    def sweep(self, namespaces: list[str], keep: Sequence[int] = (), timeout: float = 15) -> int:
        """SIGKILL whatever runs in the network namespaces (but `keep`) until nothing is left or
        `timeout` passes; returns how many processes were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while (pids := realnet.kill_all_in(namespaces, keep)) and time.monotonic() < deadline:
            killed.update(pids)
            self.reap()
            time.sleep(0.1)
        return len(killed)

    def _ours(self, name: str) -> bool:
        pid = self.pids[name]
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return self.cmds[name] in cmdline

    def reap(self) -> None:
        for proc in self.procs.values():
            proc.poll()


def renice(process_groups: Sequence[int], nice: int) -> None:
    for pgid in process_groups:
        with contextlib.suppress(ProcessLookupError):  # a node failed on purpose (chaos) has none
            os.setpriority(os.PRIO_PGRP, pgid, nice)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
