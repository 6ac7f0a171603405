"""Pytest fixtures for tiers that need a real API server; loaded by the root conftest.py.

Without KUBEBUILDER_ASSETS these tiers skip with the reason; with SGDJOB_REQUIRE_K8S=1 (CI) a
missing control plane is a failure instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.controlplane import AssetsMissing, ControlPlane, assets_dir

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "crds" / "sgdjobs.sgdjob.dev.yaml"


def _require_assets() -> None:
    try:
        assets_dir()
    except AssetsMissing as err:
        if os.environ.get("SGDJOB_REQUIRE_K8S") == "1":
            pytest.fail(f"SGDJOB_REQUIRE_K8S=1 but the control plane is unavailable: {err}")
        pytest.skip(f"no Kubernetes control plane: {err}")


@pytest.fixture(scope="session")
def k8s() -> Iterator[ControlPlane]:
    """etcd + kube-apiserver on free loopback ports, once per test session."""
    _require_assets()
    plane = ControlPlane().start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def k8s_crd(k8s: ControlPlane) -> ControlPlane:
    """The control plane with the SGDJob CRD installed and established."""
    k8s.kubectl("apply", "-f", str(CRD_FILE))
    k8s.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/sgdjobs.sgdjob.dev")
    return k8s
