"""The heterogeneity benchmark: its pure parts (time to target, aggregation, bound, table) in
milliseconds, and one tiny real run of every system (shape only, never the speed targets)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench.apiproxy import classify
from bench.operator_scale import percentile, proc_memory_mib
from bench.results import (
    SYSTEMS,
    curve_from_ddp,
    curve_from_report,
    ddp_result,
    markdown_table,
    ratios,
    sgdjob_result,
    smoothed,
    target_checks,
    time_to_target,
)
from bench.scenarios import (
    SCENARIO_NAMES,
    BenchConfig,
    bound,
    build_scenario,
    ddp_run_config,
    job_doc,
    rank_factor,
    rank_speeds,
)
from sgdjob_operator.api.validation import validate_job
from sgdjob_trainer.wire.launch_contract import RunConfig


def test_time_to_target_uses_the_smoothed_curve() -> None:
    curve = [(float(t), t, loss) for t, loss in enumerate([1.0, 0.5, 0.01, 0.5, 0.2, 0.1, 0.05, 0.05], start=1)]
    # One lucky batch (0.01 at t=3) does not count: a 3-point trailing mean first gets to <= 0.1 at t=8.
    assert [round(v, 3) for _, v in smoothed(curve, 3)] == [0.503, 0.337, 0.237, 0.267, 0.117, 0.067]
    assert time_to_target(curve, 0.1, window=3) == 8.0
    assert time_to_target(curve, 0.3, window=3) == 5.0
    assert time_to_target(curve, 0.001, window=3) is None
    assert time_to_target(curve[:2], 10.0, window=3) is None  # fewer points than the window


def test_curves_from_both_report_formats() -> None:
    report = {"loss_history": [[2, 0.5, 0.2], [1, 0.9, 0.1], [3, None, 0.3]]}
    assert curve_from_report(report) == [(0.1, 1, 0.9), (0.2, 2, 0.5)]
    ddp = {"lossCurve": [[0.0, 0, 1.3], [0.1, 1, 0.9], [0.2, 2, float("nan")]]}
    assert curve_from_ddp(ddp) == [(0.1, 1, 0.9)]  # the step-0 full-data loss is not a batch loss


def test_ddp_and_sgdjob_results_use_the_same_definitions() -> None:
    docs = [
        {
            "rank": 0,
            "samples": 320,
            "wallSeconds": 2.0,
            "computeSeconds": 0.5,
            "finalLoss": 0.02,
            "lossCurve": [[0.5 * i, i, 0.01] for i in range(1, 10)],
        },
        {"rank": 1, "samples": 320, "wallSeconds": 4.0, "computeSeconds": 1.5, "finalLoss": 0.04},
    ]
    ddp = ddp_result(docs, bound=400.0, target=0.03, expected=2)
    assert ddp["throughput"] == pytest.approx(640 / 4.0)
    assert ddp["efficiency"] == pytest.approx(160 / 400)
    assert ddp["final_loss"] == pytest.approx(0.03)
    assert ddp["time_to_target_s"] == pytest.approx(4.0)  # 8th point: the first full window
    assert ddp["ok"]
    report = {
        "throughput_samples_per_s": 300.0,
        "final_loss": 0.02,
        "loss_history": [[i, 0.02, 0.1 * i] for i in range(1, 9)],
        "mode_timeline": [{"mode": "sync", "step": 0}, {"mode": "async", "step": 5}],
    }
    ours = sgdjob_result(report, bound=400.0, target=0.03)
    assert ours["efficiency"] == pytest.approx(0.75)
    assert ours["time_to_target_s"] == pytest.approx(0.8)
    assert ours["modes"] == ["sync@0", "async@5"]
    assert ddp_result(docs[:1], 400.0, 0.03, expected=2)["ok"] is False


def test_bound_and_scenarios_follow_the_emulator_rule() -> None:
    cfg = BenchConfig(workers=4, steps=100, batch_size=32, compute_seconds=0.05)
    one = build_scenario("one-straggler", cfg)
    assert rank_speeds(cfg, one) == pytest.approx([640.0, 640.0, 640.0, 640.0 / 3])
    assert bound(cfg, build_scenario("homogeneous", cfg)) == pytest.approx(4 * 640.0)
    assert one.groups == ((0, 1, 2), (3,))
    assert build_scenario("bimodal", cfg).groups == ((0, 1), (2, 3))
    assert build_scenario("homogeneous", cfg).groups == ((0,), (1,), (2,), (3,))  # no classes: periodic averaging
    transient = build_scenario("transient", cfg)
    assert (
        rank_factor(transient.slowdowns, 0, 15) == 4.0
        and rank_factor(transient.slowdowns, 0, 14) == 1.0
        and rank_factor(transient.slowdowns, 0, 20) == 1.0
    )
    assert 3 * 640.0 < bound(cfg, transient) < 4 * 640.0
    for name in SCENARIO_NAMES:
        scenario = build_scenario(name, cfg)
        for mode in ("sync", "hierarchical", "async", "auto"):
            job = validate_job(job_doc(cfg, scenario, mode))  # every job file is a valid SGDJob
            # DDP's layout: one node (one torchrun agent) of 4 workers, none added or removed
            assert (
                job.spec.replicas == job.spec.min_workers == job.spec.max_workers == 1 and job.spec.nproc_per_node == 4
            )
            if mode == "hierarchical":
                assert job.spec.training.hierarchical.groups == [list(g) for g in scenario.groups]
        run = RunConfig.model_validate(ddp_run_config(cfg, scenario))
        assert run.reference_world_size == 4 and run.training.emulation is not None


def _systems(**throughputs: float | None) -> dict[str, dict[str, Any]]:
    return {
        k: {
            "throughput": v,
            "efficiency": None if v is None else v / 1000,
            "time_to_target_s": 10.0 if k == "ddp" else 6.0,
            "final_loss": 0.02,
            "modes": [k],
        }
        for k, v in throughputs.items()
    }


def test_ratios_targets_and_table() -> None:
    straggler = _systems(ddp=400.0, sync=410.0, hierarchical=600.0, **{"async": 850.0}, auto=880.0)
    q = ratios(straggler)
    assert q["best_static"] == "async"
    assert q["auto_over_ddp_throughput"] == pytest.approx(2.2)
    assert q["auto_over_best_static_throughput"] == pytest.approx(880 / 850)
    assert q["auto_over_ddp_time_to_target"] == pytest.approx(0.6)
    results = [
        {"scenario": "one-straggler", "systems": straggler, "ratios": q},
        {
            "scenario": "homogeneous",
            "systems": _systems(ddp=1000.0, auto=None),
            "ratios": ratios(_systems(ddp=1000.0, auto=None)),
        },
    ]
    checks = {c["target"]: c["met"] for c in target_checks(results)}
    assert checks["one-straggler: auto efficiency (of the bound)"] is True  # 0.88
    assert checks["one-straggler: auto / DDP throughput"] is True
    assert checks["homogeneous: auto / DDP throughput"] is None  # not measured: never claimed
    table = markdown_table(results, {"one-straggler": 1000.0, "homogeneous": 1000.0})
    assert "| one-straggler (bound 1000) | auto | 880 | 0.88 | 6.0 | 0.0200 | auto |" in table
    assert "| one-straggler | 2.20x | 1.04x (async) | 0.88 | 0.60x |" in table
    assert "| homogeneous: auto / DDP throughput | — | >= 0.97 | n/a |" in table


def test_operator_scale_helpers() -> None:
    assert percentile([], 50) is None
    assert percentile([float(i) for i in range(1, 101)], 50) == 50.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert classify("GET", "/api/v1/namespaces/ns/pods", {"watch": "true"}) == ("watch", "pods")
    assert classify("POST", "/api/v1/namespaces/ns/pods", {}) == ("create", "pods")
    assert classify("PATCH", "/apis/sgdjob.dev/v1alpha1/namespaces/ns/sgdjobs/a/status", {}) == (
        "patch",
        "sgdjobs/status",
    )
    assert classify("GET", "/api/v1/namespaces/ns", {}) == ("get", "namespaces")
    assert classify("DELETE", "/api/v1/namespaces/ns/pods/p", {}) == ("delete", "pods")
    rss, peak = proc_memory_mib(os.getpid())  # this Python with torch imported: tens of MiB at least
    assert 10 < rss <= peak


@pytest.mark.multiproc
def test_tiny_run_of_every_system(tmp_path: Path) -> None:
    """2 workers, a few steps, one scenario, all five systems: the output files and their shape."""
    from bench.heterogeneity import main

    out = tmp_path / "bench"
    code = main(
        [
            "--out",
            str(out),
            "--workers",
            "2",
            "--steps",
            "24",
            "--compute-seconds",
            "0.01",
            "--scenarios",
            "one-straggler",
            "--timeout",
            "240",
        ]
    )
    doc = json.loads((out / "heterogeneity.json").read_text())
    assert [r["scenario"] for r in doc["results"]] == ["one-straggler"]
    systems = doc["results"][0]["systems"]
    assert set(systems) == set(SYSTEMS)
    for name, result in systems.items():
        assert result["ok"], (name, result)
        assert {"throughput", "efficiency", "time_to_target_s", "final_loss"} <= set(result)
        assert result["throughput"] > 0 and result["efficiency"] > 0 and result["final_loss"] is not None
    assert doc["results"][0]["emulation"]["slowdowns"] == [{"rank": 1, "factor": 3.0}]
    meta = doc["metadata"]
    assert meta["steps"] == 24 and meta["workers"] == 2 and meta["machine"]["cpus"] and meta["date"]
    assert "EMULATED" in meta["emulation"] and "from the emulation config" in meta["bound_definition"]
    assert (out / "heterogeneity.png").stat().st_size > 0
    assert "| one-straggler (bound" in (out / "heterogeneity.md").read_text()
    assert code == 0
