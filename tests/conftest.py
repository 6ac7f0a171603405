"""Fixtures for every tier: the local cluster's plugin (devcluster/pytest_plugin.py: `k8s`, `k8s_assets`,
`cluster`) and the SGDJob CRD installed on it (`k8s_crd`, `cluster_crd`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from devcluster.controlplane import ControlPlane
from tests.figures import FIGURES

if TYPE_CHECKING:  # the plugin imports it in the fixture: unit-test runs need not load the Kubernetes client
    from devcluster.cluster import LocalCluster

pytest_plugins = ["devcluster.pytest_plugin"]

CRD_FILE = Path(__file__).resolve().parent.parent / "crds" / "sgdjobs.sgdjob.dev.yaml"


def install_crd(plane: ControlPlane) -> None:
    """Apply the SGDJob CRD and wait until the API server serves it."""
    plane.kubectl("apply", "-f", str(CRD_FILE))
    plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/sgdjobs.sgdjob.dev")


@pytest.fixture(scope="session")
def k8s_crd(k8s: ControlPlane) -> ControlPlane:
    """The control plane with the SGDJob CRD installed and established."""
    install_crd(k8s)
    return k8s


@pytest.fixture(scope="session")
def cluster_crd(cluster: LocalCluster) -> LocalCluster:
    """The local cluster with the SGDJob CRD installed and established."""
    install_crd(cluster.plane)
    return cluster


_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's time (setup, call, teardown) to its module's total, for the tier summary."""
    module = report.nodeid.split("::", 1)[0]
    _SPENT[module] = _SPENT.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Measured figures, then what each tier (tests/<dir>) and its costliest modules cost (CI's budget)."""
    for title, text in FIGURES.items():
        terminalreporter.section(title)
        terminalreporter.write_line(text)
    if not _SPENT:
        return
    tiers: dict[str, float] = {}
    for module, spent in _SPENT.items():
        tier = "/".join(module.split("/")[:2])
        tiers[tier] = tiers.get(tier, 0.0) + spent
    terminalreporter.section("time per tier (setup + call + teardown)")
    for tier, spent in sorted(tiers.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{spent:8.1f}s  {tier}")
    terminalreporter.section("costliest modules")
    for module, spent in sorted(_SPENT.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{spent:8.1f}s  {module}")
