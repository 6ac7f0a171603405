"""The real-node goodput benchmark (bench/goodput_nodes.py) end to end, tiny: its jobs go through the
Helm-installed operator on the session's real nodes, one worker per node. The plain DDP script runs
unmodified in command mode from the repository mounted into the pods, lb-bsp's static split reaches
the ranks from step 0 with its small batch on the node named slow, and each run's rank files come back
through the host folder as figures. The session's nodes have no CPU quotas (the benchmark's own runs
start a cluster with them), so this checks the plumbing, not the speeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.goodput import TASKS
from devcluster.realnodes import RealCluster
from e2e.real import OPERATOR_IMAGES, RealOperator

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=OPERATOR_IMAGES)]


def test_ddp_and_lb_bsp_run_as_sgdjobs_on_every_node_and_report_their_curves(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path: Path
) -> None:
    from dataclasses import replace

    from bench.goodput_nodes import Fleet, lb_split, make_namespace, run_systems

    kube = real_cluster.kube()
    make_namespace(kube)
    nodes = tuple(real_cluster.node_names())
    # Nominal CPUs: the last node named the slow one (torchrun gives it the last rank: its pod IP sorts last).
    fleet = Fleet(tuple([1.0] * (len(nodes) - 1) + [0.5]), nodes)
    cfg = replace(TASKS["digits-mlp"].config, steps=40)
    result = run_systems(kube, fleet, cfg, ["ddp", "lb-bsp"], [100], tmp_path, target=0.3, budget_s=60.0)
    for system in ("ddp", "lb-bsp"):
        [run] = result["systems"][system]["runs"]
        assert run["ok"], (system, run["error"])
        assert run["curve"] and run["final_accuracy"] is not None, system
    docs = sorted((tmp_path / "runs" / fleet.name / "ddp" / "seed-100" / "report").glob("rank-*.json"))
    assert len(docs) == len(nodes), "every DDP rank wrote its file"
    [lb] = result["systems"]["lb-bsp"]["runs"]
    split = lb_split(cfg, fleet)
    assert f"batches {split} at the end" in lb["modes"], lb["modes"]  # from step 0, never changed (mode sync)
