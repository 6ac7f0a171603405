"""Walking a node's cgroups while the kubelet removes them (a node being failed, a pod deleted)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import realhost


def test_a_cgroup_that_vanishes_during_the_walk_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "cpu" / "sgdjtest-devcluster"
    for path in ("node-0/kubepods/pod-a/c1", "node-0/kubepods/pod-b/c2"):
        (top / path).mkdir(parents=True)
    (top / "node-0/kubepods/pod-a/c1/cgroup.procs").write_text("101\n102\n")
    (top / "node-0/kubepods/pod-b/c2/cgroup.procs").write_text("201\n")
    (top / "cgroup.procs").write_text("")
    gone = top / "node-0/kubepods/pod-b"
    real_scandir = os.scandir

    def scandir(path: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
        if Path(path) == gone:  # removed between listing its parent and entering it
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(realhost, "CGROUP_V1", tmp_path)
    monkeypatch.setattr(realhost, "_hierarchies", lambda: [tmp_path / "cpu"])
    assert realhost.cgroup_pids("/sgdjtest-devcluster") == {101, 102}
    folders = realhost._tree(top)
    assert folders[-1] == top and folders.index(top / "node-0/kubepods/pod-a/c1") < folders.index(top / "node-0")
