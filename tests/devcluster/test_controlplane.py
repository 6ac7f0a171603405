"""ControlPlane.restart_apiserver: the chaos suite's API-server restart (tests/e2e/test_chaos.py case d)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devcluster.controlplane import ControlPlane
from devcluster.kube import KubeApi

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
