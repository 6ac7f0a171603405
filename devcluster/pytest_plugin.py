"""Pytest fixtures for tiers that need a real API server (`k8s`, `k8s_assets`) or the whole local cluster
(`cluster`); a plugin, loaded by tests/conftest.py (`pytest_plugins = ["devcluster.pytest_plugin"]`).

Without KUBEBUILDER_ASSETS these tiers skip with the reason; with SGDJOB_REQUIRE_K8S=1 (CI) a
missing control plane is a failure instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import pytest

from devcluster.controlplane import AssetsMissing, ControlPlane, assets_dir

if TYPE_CHECKING:  # imported in the fixture: unit-test runs need not load the Kubernetes client
    from devcluster.cluster import LocalCluster


def require_assets() -> None:
    """Skip the test without control-plane binaries (fail instead with SGDJOB_REQUIRE_K8S=1)."""
    try:
        assets_dir()
    except AssetsMissing as err:
        if os.environ.get("SGDJOB_REQUIRE_K8S") == "1":
            pytest.fail(f"SGDJOB_REQUIRE_K8S=1 but the control plane is unavailable: {err}")
        pytest.skip(f"no Kubernetes control plane: {err}")


@pytest.fixture(scope="session")
def k8s() -> Iterator[ControlPlane]:
    """etcd + kube-apiserver on free loopback ports, once per test session."""
    require_assets()
    plane = ControlPlane().start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def k8s_assets() -> Path:
    """The control-plane binaries, for tests that start their own cluster (same skip/fail rules)."""
    require_assets()
    return assets_dir()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """Control plane with controllers + the node agent: node-0..node-3 with one `nvidia.com/gpu` each
    (label nvidia.com/gpu.present=true) and node-4 without GPUs. Restart backoff and the deletion
    grace are capped low so tests stay fast. Teardown fails if any pod process outlived the agent.
    """
    require_assets()
    from devcluster.cluster import LocalCluster, default_nodes
    from devcluster.proctree import reap_orphans

    reap_orphans()  # pods of an earlier run that was SIGKILLed (only processes whose agent is gone)

    # SIGTERM (CI cancelling a run) becomes KeyboardInterrupt, so pytest still tears this down.
    restore = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        restore = signal.signal(signal.SIGTERM, _interrupt)
    # Pods run this checkout's packages (the test run's PYTHONPATH), not the ones the venv was installed from.
    pythonpath = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    local = LocalCluster(
        default_nodes(gpu_nodes=4, cpu_nodes=1), backoff_base=0.5, backoff_cap=4.0, grace_cap=5.0, extra_env=pythonpath
    )
    try:
        yield local.start()
    finally:
        local.stop()
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)
    leftovers = local.agent.leftover_pids()
    assert not leftovers, f"pod processes outlived the node agent: {leftovers}"
