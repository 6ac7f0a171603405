"""The real-node scenarios' shared fixture: the operator installed with Helm on the session's real cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from devcluster.realnodes import RealCluster
from e2e.real import RealOperator, install_operator, uninstall_operator


@pytest.fixture(scope="session")
def real_operator(real_cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealOperator]:
    """`helm install` of charts/sgdjob-operator (operator and trainer images built from the Dockerfile),
    once per session; every real-node scenario module works in a namespace of its own. At the end,
    `helm uninstall` must leave nothing of the release but the CRD (a failure there fails the session)."""
    op = install_operator(real_cluster, tmp_path_factory.mktemp("real-operator"))
    print(f"\nreal operator install timings (s): {json.dumps(op.timings)}")
    yield op
    uninstall_operator(op)
