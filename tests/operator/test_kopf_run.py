"""`kopf run -m sgdjob_operator.k8s`, configured from the environment only, reconciles a job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.operator.conftest import Cluster, wait_for

pytestmark = pytest.mark.k8s


def test_kopf_run_module(cluster: Cluster, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SGDJOB_KUBECONFIG": str(cluster.plane.kubeconfig),
        "KUBECONFIG": str(cluster.plane.kubeconfig),
        "SGDJOB_TRAINER_IMAGE": "img:env",
    }
    kopf = Path(sys.executable).parent / "kopf"
    log = open(tmp_path / "kopf.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(kopf), "run", "-m", "sgdjob_operator.k8s", "--standalone", "-n", cluster.ns],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        cluster.apply("via-kopf", {"replicas": 2})
        pods = wait_for("pods from kopf run", lambda: (p := cluster.pods("via-kopf")) and len(p) == 2 and p, timeout=90)
        assert {p.spec.containers[0].image for p in pods.values()} == {"img:env"}
        wait_for("status", lambda: cluster.status("via-kopf").get("ready") == "0/2")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        print((tmp_path / "kopf.log").read_text(errors="replace")[-3000:])
