"""Find and kill every process a test harness started (its control planes), by an environment tag.

Process groups are not enough: anything orphaned is reparented away from us. Every such process gets
`SGDJOB_DEVCLUSTER_TAG=<owner>/...` in its environment, which children inherit, so /proc/<pid>/environ
names the owner of each process like a cgroup would. Tags end in "/" so a prefix never matches a
longer sibling name; the owner part starts with the owner's pid, so the processes of a run that died
without cleaning up are found.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

TAG_KEY = "SGDJOB_DEVCLUSTER_TAG"


def new_agent_tag() -> str:
    """A tag prefix naming this process as the owner, so orphans can be told apart from live runs."""
    return f"{os.getpid()}-{secrets.token_hex(3)}/"


def _tags() -> dict[int, str]:
    """pid -> tag value of every live (non-zombie) tagged process except this one."""
    needle = f"{TAG_KEY}=".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            tag = next(
                (v[len(needle) :] for v in (entry / "environ").read_bytes().split(b"\0") if v.startswith(needle)), None
            )
            if tag is not None and _state(entry) != "Z":
                found[int(entry.name)] = tag.decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or a kernel thread
    return found


def tagged_pids(prefix: str) -> list[int]:
    """Live processes whose tag starts with `prefix`."""
    return [pid for pid, tag in _tags().items() if tag.startswith(prefix)]


def reap_orphans() -> list[int]:
    """SIGKILL pod processes whose agent process is gone (a harness that was SIGKILLed cannot clean up;
    the next one does). Processes of live agents, e.g. a parallel test run, are left alone.
    """
    dead: set[str] = set()
    for tag in _tags().values():
        owner = tag.split("-", 1)[0]
        if owner.isdigit() and not alive(int(owner)):
            dead.add(tag.split("/", 1)[0] + "/")
    return [pid for prefix in sorted(dead) for pid in kill_tagged(prefix)]


def _state(proc_dir: Path) -> str:
    stat = (proc_dir / "stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return _state(Path(f"/proc/{pid}")) != "Z"
    except (OSError, IndexError):
        return False


def kill_tagged(prefix: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL every tagged process until none is left (they may fork meanwhile); returns the pids."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = tagged_pids(prefix)
        if not pids or time.monotonic() > deadline:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.02)
