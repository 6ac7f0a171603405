"""An operator that starts before its API server serves the SGDJob CRD waits for it in its startup
(handlers.wait_for_crd) instead of letting kopf resolve its resources without it. kopf only looks again
when a CRD changes: after an API server restart whose discovery did not list the existing CRD yet, an
operator that went on never served a job (chaos case d, once in four runs). Here the CRD is created
after the operator starts, which kopf would notice by itself, so the test asserts the wait: no
"Unresolved resources" warning, and the job served."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from devcluster.controlplane import ControlPlane
from devcluster.proctree import new_agent_tag
from tests.conftest import install_crd
from tests.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture
def bare_plane(k8s_assets: Path) -> Iterator[ControlPlane]:
    """A control plane of this test's own, without the CRD."""
    plane = ControlPlane(owner_tag=new_agent_tag()).start()
    try:
        yield plane
    finally:
        plane.stop()


def test_an_operator_started_before_the_crd_serves_jobs_once_it_is_there(
    bare_plane: ControlPlane, tmp_path: Path
) -> None:
    op = Operator(bare_plane, tmp_path / "operator.log").start()
    try:
        time.sleep(3)  # the operator is up and finds no SGDJob resource in discovery
        assert op.proc is not None and op.proc.poll() is None, (tmp_path / "operator.log").read_text()[-2000:]
        install_crd(bare_plane)
        api = config.new_client_from_config(str(bare_plane.kubeconfig))
        core = client.CoreV1Api(api)
        ns = f"t-{uuid.uuid4().hex[:8]}"
        core.create_namespace({"metadata": {"name": ns}})
        core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
        cluster = Cluster(bare_plane, ns, core, client.CustomObjectsApi(api))
        cluster.apply("late", {"replicas": 2})
        wait_for("the job's worker pods", lambda: len(cluster.pods("late")) == 2, timeout=60)
        # The pass creates the pods before it writes the status; under load the phase trails them.
        wait_for("the job's status phase", lambda: bool(cluster.status("late").get("phase")), timeout=30)
        log = (tmp_path / "operator.log").read_text()
        assert "Unresolved resources cannot be served" not in log, log[-2000:]
    finally:
        op.stop()
