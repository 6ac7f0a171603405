"""Pytest fixtures for tiers that need a real API server (`k8s`, `k8s_assets`) or a cluster of real
kubelet nodes (`real_cluster`, root only); a plugin, loaded by the root conftest.py
(`pytest_plugins = ["devcluster.pytest_plugin"]`).

Without KUBEBUILDER_ASSETS these tiers skip with the reason; with SGDJOB_REQUIRE_K8S=1 (CI) a
missing control plane is a failure instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import pytest

from devcluster.controlplane import AssetsMissing, ControlPlane, assets_dir

if TYPE_CHECKING:  # imported in the fixture: unit-test runs need not load the Kubernetes client
    from devcluster.realnodes import RealCluster

REAL_PREFIX = "sgdjtest"  # not the CLI's "sgdjob": a real cluster a person started is left alone
# Four: a 3-worker job spread one per node (one GPU each) still leaves a node to replace a worker on.
REAL_NODES = 4


def require_assets() -> None:
    """Skip the test without control-plane binaries (fail instead with SGDJOB_REQUIRE_K8S=1)."""
    try:
        assets_dir()
    except AssetsMissing as err:
        unavailable(f"no Kubernetes control plane: {err}")


@pytest.fixture(scope="session")
def k8s() -> Iterator[ControlPlane]:
    """etcd + kube-apiserver on free loopback ports, once per test session (tagged as this run's, so
    the next run reaps them if this one is SIGKILLed)."""
    require_assets()
    from devcluster.proctree import new_agent_tag, reap_orphans

    reap_orphans()
    plane = ControlPlane(owner_tag=new_agent_tag()).start()
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


def _real_unavailable(reason: str) -> None:
    unavailable(f"real nodes cannot run here: {reason}")


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose prerequisite (a binary, root) this machine lacks, saying which; under
    SGDJOB_REQUIRE_K8S=1 (CI, which installs them all) fail instead, so nothing CI can run skips."""
    if os.environ.get("SGDJOB_REQUIRE_K8S") == "1":
        pytest.fail(f"SGDJOB_REQUIRE_K8S=1 but {reason}")
    pytest.skip(reason)


# What the cluster's start may take beyond pytest's per-test limit: the first real-node test's setup
# waits for it, and on a fresh machine that is every image built and imported into every node beside
# the other tests (about 5 minutes on an idle machine, 18 in a CI-like run beside the other half; CI once
# needed more than 600 s).
START_BUDGET_S = 1800
# The cluster's stop runs in the last real-node test's teardown, inside that test's timeout: stopping
# every node and removing the unpacked images took up to 143 s in CI-like runs, and a 591-s last test
# left it 9 s (stop 26's CI failed so).
STOP_BUDGET_S = 600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Real-node tests run last, one after another (in their collected order); their cluster is started
    in the background meanwhile (`pytest_collection_finish`): the first of them may wait START_BUDGET_S
    longer for it, and the last STOP_BUDGET_S longer for its stop."""
    items.sort(key=lambda item: item.get_closest_marker("realnode") is not None)
    real = [item for item in items if item.get_closest_marker("realnode") is not None]
    if not real or not config.pluginmanager.hasplugin("timeout"):
        return
    for item in dict.fromkeys((real[0], real[-1])):  # one item when a single real-node test runs
        extra = (START_BUDGET_S if item is real[0] else 0) + (STOP_BUDGET_S if item is real[-1] else 0)
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0]) if marker is not None and marker.args else float(config.getini("timeout") or 0)
        if limit > 0:  # 0: no limit at all
            item.add_marker(pytest.mark.timeout(limit + extra), append=False)  # read before any own


class RealClusterStart:
    """The session's real cluster, started in a thread of its own: control plane, REAL_NODES nodes, and
    the images the selected tests name in `@pytest.mark.realnode(images=[...])` (plus pause and python)
    built and imported into every node. Started when collection ends, it overlaps the ~25 minutes of
    tiers that run before the real-node tests (its daemons at nice 19; builds and imports at normal
    priority, as the real-node tests wait for them); the `real_cluster` fixture waits for it."""

    def __init__(self, images: Sequence[str]) -> None:
        self.images = ["pause", "python", *(i for i in images if i not in ("pause", "python"))]
        self.cluster: RealCluster | None = None
        self.error: BaseException | None = None
        self.handed_out = False
        self._thread = threading.Thread(target=self._run, name="real-cluster-start", daemon=True)

    def start(self) -> RealClusterStart:
        self._thread.start()
        return self

    def _run(self) -> None:
        from devcluster.images import ImageBuilder
        from devcluster.realnodes import RealCluster

        try:
            t0 = time.monotonic()
            builder = ImageBuilder()
            built = [builder.get(name) for name in self.images]
            build_s = round(time.monotonic() - t0, 1)
            workdir = Path(tempfile.mkdtemp(prefix=f"{REAL_PREFIX}-"))
            self.cluster = RealCluster(workdir, nodes=REAL_NODES, prefix=REAL_PREFIX)
            self.cluster.start(built)
            self.cluster.timings["image builds"] = build_s
        except BaseException as err:  # handed to the fixture, which skips or fails saying why
            self.error = err
            self.cluster = None

    def wait(self) -> RealCluster:
        self._thread.join()
        self.handed_out = True
        if self.error is not None:
            raise self.error
        assert self.cluster is not None
        return self.cluster


_START = pytest.StashKey[RealClusterStart]()


def _host_unavailable() -> str | None:
    from devcluster.realhost import unavailable  # loaded only where real-node tests are collected

    return unavailable()


def session_cluster_images(items: Sequence[pytest.Item]) -> list[str] | None:
    """The images the session's cluster needs (those named by the realnode markers of the tests that
    use `real_cluster`), or None when no selected test uses it: a real-node test that starts a cluster
    of its own (tests/devcluster/test_realnodes_cpus.py) needs no second one beside it."""
    users = [item for item in items if "real_cluster" in getattr(item, "fixturenames", ())]
    marks = [m for item in users for m in item.iter_markers("realnode")]
    if not marks:
        return None
    return sorted({name for m in marks for name in m.kwargs.get("images", ())})


def pytest_collection_finish(session: pytest.Session) -> None:
    images = session_cluster_images(session.items)
    if images is None or session.config.option.collectonly or _host_unavailable() is not None:
        return
    session.config.stash[_START] = RealClusterStart(images).start()
    # The cluster now lives through the whole session: SIGTERM (CI cancelling a run) becomes
    # KeyboardInterrupt, so pytest still reaches the teardown that stops it.
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a cluster that was started but never handed to a test (a run cut short, or its tests skipped)."""
    start = session.config.stash.get(_START, None)
    if start is None or start.handed_out:
        return
    try:
        cluster = start.wait()
    except BaseException:  # start() cleaned up after itself
        return
    cluster.stop()


# Session scope: several modules use it (the cluster's own tests, the end-to-end scenarios), and
# the collection hook above runs them together at the end.
@pytest.fixture(scope="session")
def real_cluster(request: pytest.FixtureRequest) -> Iterator[RealCluster]:
    """Control plane + REAL_NODES real kubelet nodes (devcluster/realnodes.py) with the pause and python images
    (`python:3.11-slim-bookworm`, imagePullPolicy Never) and those the tests name in every node. Root
    only: otherwise the tests skip saying why (fail with SGDJOB_REQUIRE_K8S=1). Teardown fails if
    anything of it is left: processes, network namespaces, cgroups, mounts or its folder. `timings`
    holds up's phases."""
    from devcluster.realhost import HostNotReady

    reason = _host_unavailable()
    if reason is not None:
        _real_unavailable(reason)
    start = request.config.stash.get(_START, None)
    if start is None:  # a test asked for the cluster without the marker
        start = request.config.stash[_START] = RealClusterStart([]).start()
    try:
        cluster = start.wait()
    except HostNotReady as err:
        _real_unavailable(str(err))
    try:
        yield cluster
    finally:
        t0 = time.monotonic()
        problems = cluster.stop()
        print(f"\nreal cluster: up {cluster.timings}, down {time.monotonic() - t0:.1f} s")
    assert_nothing_left(cluster, problems)


def assert_nothing_left(cluster: RealCluster, problems: list[str]) -> None:
    """After `cluster.stop()` (which returned `problems`): no process, network namespace, cgroup
    process or folder of it is left."""
    from devcluster.realhost import cgroup_pids
    from devcluster.realnet import exists

    lay = cluster.layout
    assert not problems, problems
    assert not [n for n in [lay.fabric_ns, *(lay.node_ns(i) for i in range(lay.nodes))] if exists(n)], "netns left"
    assert not cgroup_pids(lay.cgroup_root), "processes left in the cluster's cgroups"
    naming = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _names(p, str(lay.workdir))]
    assert not naming, f"processes still naming the cluster's folder: {naming}"
    assert not lay.workdir.exists()


def _names(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
