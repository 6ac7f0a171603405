"""Tag-based process cleanup: what makes "no process outlives the harness" hold (no control plane needed)."""

from __future__ import annotations

import os
import subprocess
import time

from devcluster.proctree import TAG_KEY, alive, kill_tagged, new_agent_tag, reap_orphans, tagged_pids


def _spawn(tag: str) -> subprocess.Popen[bytes]:
    # A shell that starts a child in a new session (as torchrun does with its workers), then waits.
    script = "setsid sleep 60 & wait"
    return subprocess.Popen(["sh", "-c", script], env={**os.environ, TAG_KEY: tag}, start_new_session=True)


def _settle(prefix: str, count: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(pids := tagged_pids(prefix)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def test_kill_tagged_reaches_processes_in_other_sessions() -> None:
    tag = new_agent_tag()
    shell = _spawn(f"{tag}pod/ctr/")
    pids = _settle(tag, 2)
    assert len(pids) == 2 and shell.pid in pids
    assert sorted(kill_tagged(f"{tag}pod/")) == sorted(pids)
    shell.wait(timeout=5)
    assert not tagged_pids(tag) and not any(alive(p) for p in pids)


def test_reap_orphans_kills_only_processes_whose_agent_is_gone() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan_tag, live_tag = f"{gone.pid}-dead00/", new_agent_tag()  # an agent pid that exited; ours
    orphan, live = _spawn(f"{orphan_tag}pod/ctr/"), _spawn(f"{live_tag}pod/ctr/")
    try:
        orphans, lives = _settle(orphan_tag, 2), _settle(live_tag, 2)
        assert len(orphans) == 2 and len(lives) == 2
        assert set(orphans) <= set(reap_orphans())
        assert not tagged_pids(orphan_tag) and tagged_pids(live_tag) == lives
    finally:
        kill_tagged(live_tag)
        kill_tagged(orphan_tag)
        orphan.wait(timeout=5)
        live.wait(timeout=5)
