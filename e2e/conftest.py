"""The real-node scenarios' shared fixture: the operator installed with Helm on the session's real cluster."""

from __future__ import annotations

import json

import pytest

from devcluster.realnodes import RealCluster
from e2e.real import RealOperator, install_operator


@pytest.fixture(scope="session")
def real_operator(real_cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> RealOperator:
    """`helm install` of charts/sgdjob-operator (operator and trainer images built from the Dockerfile),
    once per session; every real-node scenario module works in a namespace of its own."""
    op = install_operator(real_cluster, tmp_path_factory.mktemp("real-operator"))
    print(f"\nreal operator install timings (s): {json.dumps(op.timings)}")
    return op
