"""Worker processes on this machine: free ports, starting agents in their own process groups, and
stopping everything they started, with no orphan left behind.

Workers forked by the agent (sgdjob_trainer.agent) share its process group, but torchrun's own exec'd
workers run in sessions of their own, which killing the agent's group does not reach. The set
therefore also tracks every descendant it has seen (pid plus start time from /proc, so a reused pid
is never signalled) and signals those directly. On Linux each agent
also gets a parent-death signal, so even a runner killed with SIGKILL takes its agents down.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, Protocol, TypeVar

from sgdjob_operator.local.cpulimit import join_cgroup
from sgdjob_operator.local.launch import LOOPBACK

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(cgroup_procs: Path | None) -> Callable[[], None] | None:
    """What a child runs before exec: the parent-death signal, and joining its CPU-limited cgroup
    (local.cpulimit) so every process it forks is born inside the quota."""
    if cgroup_procs is None:
        return _die_with_parent if _LIBC is not None else None
    target = str(cgroup_procs)

    def setup() -> None:
        _die_with_parent()
        join_cgroup(target)

    return setup


# Below the kernel's ephemeral range (ip_local_port_range), from which connect() and bind(0) take
# their ports by themselves: a port checked free here stays free until the worker binds it seconds
# later. Inside that range it did not: with several workers per agent, a gloo or store connection
# opened meanwhile could get a chosen metrics port as its local port, and the worker failed to serve.
PORT_FLOOR = 10000
_EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT
    return low, high


def free_port_blocks(count: int, size: int = 1, host: str = LOOPBACK, attempts: int = 500) -> list[int]:
    """`count` distinct first ports of blocks of `size` consecutive ports free on `host` now, all
    below the ephemeral range (see PORT_FLOOR). All sockets are held until every block is found, so
    the blocks do not overlap."""
    ephemeral = ephemeral_ports()
    low, high = PORT_FLOOR, ephemeral[0] - size
    if high <= low:
        raise OSError(f"no room for ports below the ephemeral range {ephemeral} (net.ipv4.ip_local_port_range)")
    held: list[socket.socket] = []
    bases: list[int] = []
    try:
        for _ in range(attempts):
            if len(bases) == count:
                break
            base = random.randrange(low, high)
            block: list[socket.socket] = []
            try:
                for port in range(base, base + size):
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    block.append(sock)
                    sock.bind((host, port))
            except OSError:
                for sock in block:
                    sock.close()
                continue
            held.extend(block)
            bases.append(base)
        if len(bases) < count:
            raise OSError(
                f"could not find {count} blocks of {size} free ports on {host} between {low} and {high + size}"
            )
        return bases
    finally:
        for sock in held:
            sock.close()


@dataclass(frozen=True, slots=True)
class ProcId:
    """A process identity that survives pid reuse: pid plus start time in clock ticks."""

    pid: int
    start: int


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start ticks) of a live process from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def is_alive(proc: ProcId) -> bool:
    """True while the process runs (a zombie counts as gone)."""
    st = _stat(proc.pid)
    return st is not None and st[3] == proc.start and st[0] not in ("Z", "X")


def proc_id(pid: int) -> ProcId | None:
    st = _stat(pid)
    return ProcId(pid, st[3]) if st is not None else None


def descendants(roots: Iterable[int]) -> set[ProcId]:
    """Every live descendant of the given pids (not the pids themselves), from one /proc scan."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[1], []).append(int(entry))
    out: set[ProcId] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            pid = proc_id(child)
            if pid is not None and pid not in out:
                out.add(pid)
                stack.append(child)
    return out


def processes_in_group(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[2] == pgid and st[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


class Launchable(Protocol):
    """What starting a process needs (an AgentPlan, a StorePlan)."""

    @property
    def node(self) -> str: ...
    @property
    def argv(self) -> tuple[str, ...]: ...
    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def log_path(self) -> Path: ...


P = TypeVar("P", bound=Launchable)


class Agent(Generic[P]):
    """One started process (a torchrun agent, the rendezvous store), leader of its own process
    group, logging to its log file. `retired` marks an agent the runner stopped on purpose."""

    def __init__(self, plan: P, cgroup_procs: Path | None = None) -> None:
        self.plan = plan
        self.retired = False
        plan.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = plan.log_path.open("wb")
        self.popen = subprocess.Popen(
            list(plan.argv),
            env=dict(plan.env),
            cwd=getattr(plan, "cwd", None),  # an AgentPlan of command mode: the script's folder
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_child_setup(cgroup_procs),
        )
        self.id = proc_id(self.popen.pid) or ProcId(self.popen.pid, -1)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def close_log(self) -> None:
        self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.plan.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ProcessSet(Generic[P]):
    """All agents of a run, its services (the rendezvous store) and every descendant seen; `stop`
    ends them all, `retire` one agent with its own descendants."""

    def __init__(self) -> None:
        self.agents: list[Agent[P]] = []
        self.services: list[Agent[Launchable]] = []
        self.known: set[ProcId] = set()
        self.hurry = threading.Event()  # set (from any thread) to cut a running `stop`'s grace short
        self.cgroups: dict[str, Path] = {}  # node -> cgroup.procs of its CPU limit (local.cpulimit)

    def start(self, plans: Sequence[P]) -> list[Agent[P]]:
        started = [Agent(plan, self.cgroups.get(plan.node)) for plan in plans]
        self.agents.extend(started)
        return started

    def start_service(self, plan: Launchable) -> Agent[Launchable]:
        service: Agent[Launchable] = Agent(plan)
        self.services.append(service)
        return service

    def _all(self) -> list[Agent[Any]]:
        return [*self.services, *self.agents]

    def track(self) -> None:
        """Remember the current descendants, so they can be ended even after their agent is gone."""
        self.known |= descendants(a.popen.pid for a in self._all() if a.returncode is None)
        self.known = {p for p in self.known if is_alive(p)}

    def running(self) -> list[Agent[P]]:
        """Agents still running that the runner has not retired."""
        return [a for a in self.agents if a.returncode is None and not a.retired]

    def alive(self) -> list[ProcId]:
        """Every started process (agents, services and tracked descendants) still running."""
        return [a.id for a in self._all() if a.returncode is None] + [p for p in self.known if is_alive(p)]

    def _signal(self, sig: signal.Signals, agents: Sequence[Agent[Any]], procs: Iterable[ProcId]) -> None:
        for agent in agents:
            if agent.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(agent.popen.pid, sig)
        for proc in procs:
            if is_alive(proc):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, sig)

    def _end(self, agents: Sequence[Agent[Any]], procs: set[ProcId], grace_s: float) -> None:
        """SIGTERM, wait up to `grace_s`, SIGKILL what is left, reap."""

        def left() -> bool:
            return any(a.returncode is None for a in agents) or any(is_alive(p) for p in procs)

        self._signal(signal.SIGTERM, agents, procs)
        deadline = time.monotonic() + grace_s
        while left() and time.monotonic() < deadline and not self.hurry.is_set():
            time.sleep(0.05)
        if left():
            procs |= descendants(a.popen.pid for a in agents if a.returncode is None)
            self._signal(signal.SIGKILL, agents, procs)
            deadline = time.monotonic() + 5.0
            while left() and time.monotonic() < deadline:
                time.sleep(0.05)
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.popen.wait(timeout=1.0)
            agent.close_log()

    def retire(self, agent: Agent[P], grace_s: float = 10.0) -> None:
        """Stop one agent and its trainer processes (blocking): a worker leaving the job on purpose.
        Its trainers get SIGTERM first, so they stop at an agreed step with a final checkpoint."""
        agent.retired = True
        mine = descendants([agent.popen.pid])
        self._end([agent], mine, grace_s)
        self.known -= mine

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM everything, wait up to `grace_s`, then SIGKILL what is left; reap everything.
        Agents go first and the store last, so no agent loses its rendezvous while it stops."""
        self.track()
        self._end(self.agents, set(self.known), grace_s)
        self._end(self.services, set(), grace_s)
