"""Helm against a local cluster, and the chart's RBAC as a set of permissions: shared by the chart
tests and the real-node Helm tier (e2e/real.py, e2e/test_helm_operator.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Protocol

from tests.packaging.test_chart import _helm, _render


class HasKubeconfig(Protocol):
    @property
    def kubeconfig(self) -> Path: ...


def helm_kc(cluster: HasKubeconfig, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`helm` against a local cluster; fails with its output."""
    result = subprocess.run(
        [_helm(), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args[:2])}: {result.stdout}\n{result.stderr}"
    return result


def expand(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def chart_permissions(*options: str) -> set[tuple[str, str, str]]:
    """What the chart grants the operator (Role and ClusterRole rules, expanded), rendered with `options`."""
    roles = [d for d in _render(*options) if d["kind"] in ("ClusterRole", "Role")]
    perms = set().union(*(expand(r["rules"]) for r in roles))
    assert not {p for p in perms if "*" in p}, "wildcards in the chart's RBAC"
    return perms
