"""`python -m devcluster up --process-nodes|down` (the test double; `up` without it starts real nodes, which
tests/devcluster/test_realnodes.py covers): a cluster that runs pods, and nothing left after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster.kube import KubeApi, pod_path
from devcluster.proctree import alive, tagged_pids
from devcluster.testing import container_pid, phase_in, wait_for, wait_ready_namespace

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]


def test_cluster_command_brings_a_cluster_up_and_leaves_nothing_behind(k8s_assets: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    cli = [sys.executable, "-m", "devcluster"]
    up = subprocess.run(
        [*cli, "up", "--process-nodes", "--state", str(state), "--gpu-nodes", "1", "--cpu-nodes", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.startswith("export KUBECONFIG=")
        info = json.loads(state.read_text())
        kube = KubeApi(up.stdout.strip().split("=", 1)[1], ca_file=Path(info["workdir"]) / "certs" / "apiserver.crt")
        assert [n["metadata"]["name"] for n in kube.get("/api/v1/nodes")["items"]] == ["node-0"]
        wait_ready_namespace(kube, "default")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "idle"},
            "spec": {"containers": [{"name": "main", "image": "x", "command": ["sleep", "300"]}]},
        }
        kube.create(pod_path("default"), pod)
        running = wait_for(lambda: phase_in(kube, "default", "idle", "Running"), 60, "a pod on the CLI's cluster")
        pids = [int(info["pid"]), *map(int, info["pids"].values()), container_pid(running)]
        assert all(alive(p) for p in pids)
    finally:
        down = subprocess.run(
            [*cli, "down", "--state", str(state)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
    assert down.returncode == 0, down.stderr
    assert not any(alive(p) for p in pids) and not tagged_pids(info["tag"])
    assert not Path(info["workdir"]).exists() and not state.exists()
