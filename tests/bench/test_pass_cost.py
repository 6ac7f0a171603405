"""The pass-cost benchmark at the smallest size: one job of 2 real trainer servers in a child
process, a few passes of the operator's scrape and policy code. Checks the JSON's shape and that
every cost is measured (positive and finite), not the figures themselves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.pass_cost import CPU_SHARE, FLEET_JOBS, INTERVALS_S, main

PHASES = ("scrape", "policy", "push", "status", "total")


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_a_tiny_run_writes_finite_positive_costs(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--workers", "2", "--sizes", "2", "--passes", "5", "--warmup", "2"]
    assert main([*args, "--sample-from", "status,metrics"]) == 0
    doc = json.loads((tmp_path / "pass_cost.json").read_text())
    assert set(doc) == {"machine", "settings", "sizes", "fit", "capacity", "sources", "ratios"}
    assert doc["sizes"] == doc["sources"]["status"]["sizes"], "the first source's figures are the doc's"
    assert set(doc["ratios"]["metrics"]) == {"2_total", "2_scrape"}
    assert all(_positive(v) for v in doc["ratios"]["metrics"].values())
    # From /status each pass asks each worker once, and rank 0's status comes with its sample; from
    # /metrics each worker's /metrics and then rank 0's /status (the one /metrics more: the parse cost's).
    by_status = doc["sources"]["status"]["sizes"]["2"]["trainer"]["requests"]
    by_metrics = doc["sources"]["metrics"]["sizes"]["2"]["trainer"]["requests"]
    assert by_status["/status"] == 2 * 5 and by_status.get("/metrics", 0) <= 1, by_status
    assert by_metrics["/metrics"] >= 2 * 5 and by_metrics["/status"] == 5, by_metrics
    assert doc["settings"]["sizes"] == [2] and doc["fit"] is None  # one size: nothing to fit
    job = doc["sizes"]["2"]
    assert job["workers"] == 2 and job["passes"] == 5 and len(job["passes_detail"]) == 5
    assert job["scrape_errors"] == 0
    assert job["evaluated"] == 5  # past the first window every pass evaluates
    assert sum(job["decisions"].values()) == 5
    for phase in PHASES:
        stats = job["cpu_ms"][phase]
        assert set(stats) == {"mean", "median", "p90"}
        assert all(math.isfinite(v) and v >= 0 for v in stats.values())
    for phase in ("scrape", "policy", "status", "total"):
        assert _positive(job["cpu_ms"][phase]["mean"]), phase
    assert _positive(job["scrape_wall_ms"]["median"]) and _positive(job["parse_metrics_ms_per_worker"])
    trainer = job["trainer"]
    assert _positive(trainer["cpu_ms_per_request"])
    assert all(_positive(v) for v in trainer["handler_cpu_ms"].values())
    assert trainer["payload_bytes"]["/metrics"] > 1000 and trainer["payload_bytes"]["/status"] > 100
    with pytest.raises(SystemExit):
        main([*args, "--sample-from", "stdout"])
    cap = doc["capacity"]
    assert _positive(cap["cpu_ms_per_pass"])
    assert set(cap["jobs_per_core"]) == {f"{i:g}" for i in INTERVALS_S}
    assert all(_positive(v) for v in cap["jobs_per_core"].values())
    assert all(_positive(v) for v in cap[f"jobs_per_core_at_{CPU_SHARE:g}"].values())
    assert _positive(cap[f"least_interval_s_for_{FLEET_JOBS}_jobs_at_{CPU_SHARE:g}"])
    assert all(_positive(v) for v in cap["trainer_core_share"].values())
