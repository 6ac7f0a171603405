"""Helpers for tests against a local cluster (devcluster/realnodes.py, or a bare control plane):
waiting, namespaces, reading pods."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

from devcluster.kube import KubeApi, pod_path

T = TypeVar("T")
Obj = dict[str, Any]


def wait_for(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll `check` (0.2 s) until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_ready_namespace(kube: KubeApi, ns: str) -> None:
    """Pods are refused until the namespace's default ServiceAccount has its token (controller-made)."""
    wait_for(
        lambda: (kube.get_or_none(f"/api/v1/namespaces/{ns}/serviceaccounts/default") or {}).get("secrets"),
        30,
        f"default SA in {ns}",
    )


def new_namespace(kube: KubeApi, prefix: str) -> str:
    """A fresh namespace, ready for pods."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_ready_namespace(kube, name)
    return name


def phase_in(kube: KubeApi, ns: str, name: str, *phases: str) -> Obj | None:
    """The pod when its phase is one of `phases`, else None."""
    pod = kube.get_or_none(pod_path(ns, name))
    return pod if pod and pod.get("status", {}).get("phase") in phases else None
