"""With kube-controller-manager running, the ownerReferences alone clean up a deleted job, even with
no operator running to do it explicitly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from devcluster.controlplane import ControlPlane
from devcluster.pytest_plugin import require_assets
from tests.conftest import install_crd
from tests.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture(scope="module")
def gc_plane() -> Iterator[ControlPlane]:
    require_assets()
    plane = ControlPlane(with_controllers=True).start()
    try:
        install_crd(plane)
        yield plane
    finally:
        plane.stop()


def test_deleted_job_is_garbage_collected(gc_plane: ControlPlane, tmp_path: Path) -> None:
    api = config.new_client_from_config(str(gc_plane.kubeconfig))
    cluster = Cluster(gc_plane, "default", client.CoreV1Api(api), client.CustomObjectsApi(api))
    wait_for("default service account", lambda: cluster.core.read_namespaced_service_account("default", "default"))
    op = Operator(gc_plane, tmp_path / "operator.log").start()
    try:
        cluster.apply("gc", {"replicas": 2})
        wait_for("pods", lambda: len(cluster.pods("gc")) == 2 and cluster.pods("gc", role="rendezvous"), timeout=90)
        wait_for("config map", lambda: cluster.core.read_namespaced_config_map("gc-config", "default"))
    finally:
        op.stop()  # no operator from here on: only the garbage collector can clean up
    gc_plane.kubectl("delete", "sgdjob", "gc", "--wait=false")

    def gone() -> bool:
        core = cluster.core
        pods = [
            p
            for p in core.list_namespaced_pod("default").items
            if p.metadata.name.startswith("gc-") and not p.metadata.deletion_timestamp
        ]
        names = {o.metadata.name for o in core.list_namespaced_secret("default").items} | {
            o.metadata.name for o in core.list_namespaced_config_map("default").items
        }
        return (
            not pods
            and not {"gc-control", "gc-config"} & names
            and "gc" not in {s.metadata.name for s in core.list_namespaced_service("default").items}
        )

    wait_for("garbage collection", gone, timeout=120)
