"""ControlPlane.restart_apiserver (the chaos suite's API-server restart, e2e/test_chaos.py case d)
and the reaping of a control plane whose test run was SIGKILLed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from devcluster.controlplane import ControlPlane
from devcluster.kube import KubeApi
from devcluster.proctree import alive, new_agent_tag, reap_orphans

pytestmark = pytest.mark.k8s


def test_api_server_restart_keeps_its_address_certificate_and_objects(k8s_assets: Path) -> None:
    plane = ControlPlane().start()
    try:
        kube = KubeApi(plane.kubeconfig, ca_file=plane.workdir / "certs" / "apiserver.crt")
        kube.create(
            "/api/v1/namespaces/default/configmaps",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kept"}, "data": {"k": "v"}},
        )
        server, first = plane.server, plane.procs["kube-apiserver"].pid
        plane.restart_apiserver(down_s=1.0)
        assert plane.procs["kube-apiserver"].pid != first and plane.server == server
        # The same client (same address, same CA bundle) reads what was written before: etcd kept it.
        assert kube.get("/api/v1/namespaces/default/configmaps/kept")["data"] == {"k": "v"}
        assert plane.kubectl("get", "configmap", "kept", "-n", "default").returncode == 0
    finally:
        plane.stop()


def test_a_control_plane_whose_owner_died_is_reaped_and_a_live_owners_is_not(k8s_assets: Path) -> None:
    # The owner of `orphaned` is a process that has exited, as a pytest run SIGKILLed mid-session.
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphaned = ControlPlane(owner_tag=f"{gone.pid}-dead00/").start()
    kept = ControlPlane(owner_tag=new_agent_tag()).start()  # owned by this live test process
    try:
        pids = {name: p.pid for name, p in orphaned.procs.items()}
        assert set(pids) == {"etcd", "kube-apiserver"} and all(alive(pid) for pid in pids.values())
        killed = reap_orphans()
        assert set(pids.values()) <= set(killed)
        for proc in orphaned.procs.values():
            proc.wait(timeout=10)
        assert all(alive(p.pid) for p in kept.procs.values())
        assert kept.kubectl("get", "namespaces").returncode == 0
    finally:
        orphaned.stop()
        kept.stop()
