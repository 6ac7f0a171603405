"""A real-node cluster killed before its stop leaves its network namespaces behind; the next start
removes them when no process is left in them, and refuses (someone's live cluster) otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import realnet
from devcluster.pytest_plugin import unavailable
from devcluster.realconf import Layout
from devcluster.realhost import reclaim_abandoned

PREFIX = "sgdjunit"


@pytest.fixture(autouse=True)
def _root_and_iproute2() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("network namespaces need root and iproute2")


@pytest.fixture
def leftovers() -> Iterator[list[str]]:
    # node 5 although the new layout has 3: an earlier run may have had more nodes
    names = [f"{PREFIX}-fabric", f"{PREFIX}-node-0", f"{PREFIX}-node-5"]
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    yield names
    for name in names:
        if realnet.exists(name):
            subprocess.run(["ip", "netns", "del", name], check=False)


def test_namespaces_with_no_process_left_are_removed(tmp_path: Path, leftovers: list[str]) -> None:
    assert reclaim_abandoned(Layout(tmp_path, 3, PREFIX))
    assert [n for n in leftovers if realnet.exists(n)] == []


def test_a_cluster_with_a_live_process_is_left_alone(tmp_path: Path, leftovers: list[str]) -> None:
    proc = subprocess.Popen(["ip", "netns", "exec", leftovers[2], "sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while not realnet.pids_in([leftovers[2]]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not reclaim_abandoned(Layout(tmp_path, 3, PREFIX))
        assert all(realnet.exists(n) for n in leftovers)
    finally:
        proc.kill()
        proc.wait()
