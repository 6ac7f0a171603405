"""Pytest fixtures for tiers that need a real API server (`k8s`, `k8s_assets`), the whole local cluster
(`cluster`), or real kubelet nodes (`real_cluster`, root only); a plugin, loaded by tests/conftest.py
(`pytest_plugins = ["devcluster.pytest_plugin"]`).

Without KUBEBUILDER_ASSETS these tiers skip with the reason; with SGDJOB_REQUIRE_K8S=1 (CI) a
missing control plane is a failure instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import pytest

from devcluster.controlplane import AssetsMissing, ControlPlane, assets_dir

if TYPE_CHECKING:  # imported in the fixture: unit-test runs need not load the Kubernetes client
    from devcluster.cluster import LocalCluster
    from devcluster.realnodes import RealCluster

REAL_PREFIX = "sgdjtest"  # not the CLI's "sgdjob": a real cluster a person started is left alone
# Four, as the process cluster has four GPU nodes: a 3-worker job spread one per node still leaves a
# node to replace a worker on.
REAL_NODES = 4


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


def _real_unavailable(reason: str) -> None:
    if os.environ.get("SGDJOB_REQUIRE_K8S") == "1":
        pytest.fail(f"SGDJOB_REQUIRE_K8S=1 but real nodes cannot run here: {reason}")
    pytest.skip(f"real nodes cannot run here: {reason}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-node tests run last, one after another (in their collected order): the session's real
    cluster (~1 GB, some CPU while up) then never idles through the other tiers."""
    items.sort(key=lambda item: item.get_closest_marker("realnode") is not None)


# Session scope: several modules use it (the cluster's own tests, the end-to-end scenarios), and
# the collection hook above runs them together at the end.
@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """Control plane + REAL_NODES real kubelet nodes (devcluster/realnodes.py) with the pause and python images
    (`python:3.11-slim-bookworm`, imagePullPolicy Never) in every node. Root only: otherwise the tests
    skip saying why (fail with SGDJOB_REQUIRE_K8S=1). Teardown fails if anything of it is left:
    processes, network namespaces, cgroups, mounts or its folder. `timings` holds up's phases."""
    from devcluster.images import ImageBuilder
    from devcluster.realhost import HostNotReady, cgroup_pids
    from devcluster.realnet import exists
    from devcluster.realnodes import NODE_BINARIES, RealCluster

    if os.geteuid() != 0:
        _real_unavailable("needs root (network namespaces, containerd, cgroups)")
    try:
        missing = [b for b in NODE_BINARIES if not (assets_dir() / b).is_file()]
    except AssetsMissing as err:
        _real_unavailable(str(err))
    if missing:
        _real_unavailable(f"KUBEBUILDER_ASSETS lacks {', '.join(missing)} (../shared/k8s/install.sh provides them)")
    builder = ImageBuilder()
    images = [builder.pause(), builder.python()]
    cluster = RealCluster(tmp_path_factory.mktemp("realnodes"), nodes=REAL_NODES, prefix=REAL_PREFIX)
    try:
        cluster.start(images)
    except HostNotReady as err:
        _real_unavailable(str(err))
    cluster.timings["base images"] = sum(builder.timings.values())
    try:
        yield cluster
    finally:
        t0 = time.monotonic()
        problems = cluster.stop()
        print(f"\nreal cluster: up {cluster.timings}, down {time.monotonic() - t0:.1f} s")
    lay = cluster.layout
    assert not problems, problems
    assert not [n for n in [lay.fabric_ns, *(lay.node_ns(i) for i in range(REAL_NODES))] if exists(n)], "netns left"
    assert not cgroup_pids(lay.cgroup_root), "processes left in the cluster's cgroups"
    naming = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _names(p, str(lay.workdir))]
    assert not naming, f"processes still naming the cluster's folder: {naming}"
    assert not lay.workdir.exists()


def _names(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
