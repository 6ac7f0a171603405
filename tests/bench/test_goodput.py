"""The goodput benchmark: its pure parts (curves, time to target, accuracy at budget, aggregation
over seeds, table, the ddp-drop and lb-bsp set-ups) in milliseconds, and one tiny real run of every
system (shape only)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from bench.goodput import CONFIG, lb_batches, run_order, step_aligned, time_aligned
from bench.goodput_scoring import (
    SYSTEMS,
    accuracy_at,
    accuracy_points,
    aggregate,
    markdown_table,
    run_result,
    spread,
    time_to_accuracy,
)
from bench.scenarios import (
    GOODPUT_SCENARIOS,
    BenchConfig,
    build_scenario,
    ddp_run_config,
    job_doc,
    rank_factor,
    slowest_rank,
    without_rank,
)
from bench.systems import RunRecord
from sgdjob_operator.api.validation import validate_job
from sgdjob_operator.local.cpulimit import detect

CURVE: list[dict[str, Any]] = [
    {"step": 0, "time_s": 0.0, "samples": 0, "loss": 2.3, "accuracy": 0.1},
    {"step": 10, "time_s": 1.0, "samples": 320, "loss": 1.0, "accuracy": 0.6},
    {"step": 20, "time_s": 2.0, "samples": 640, "loss": 0.5, "accuracy": 0.92},
    {"step": 30, "time_s": 3.0, "samples": 960, "loss": 0.4, "accuracy": 0.88},
    {"step": 40, "time_s": 4.0, "samples": 1280, "loss": 0.3, "accuracy": None},
]


def test_time_to_target_and_accuracy_at_budget_from_a_curve() -> None:
    points = accuracy_points(list(reversed(CURVE)))
    assert points == [(0.0, 0.1), (1.0, 0.6), (2.0, 0.92), (3.0, 0.88)]  # rows without accuracy dropped
    assert time_to_accuracy(points, 0.9) == 2.0
    assert time_to_accuracy(points, 0.6) == 1.0  # at or above
    assert time_to_accuracy(points, 0.95) is None
    assert accuracy_at(points, 2.5) == 0.92
    assert accuracy_at(points, 3.0) == 0.88  # the last validation at or before the budget, not the best
    assert accuracy_at(points, 100.0) == 0.88  # a run that ended before the budget keeps its final model
    assert accuracy_at(points[1:], 0.5) is None


def test_a_target_counts_as_reached_when_three_validations_hold_it() -> None:
    """One validation over the target between two well under it is not a model trained to it: the
    sustained figures take the mean of the last three validations (fewer only before three ran)."""
    swinging = [(1.0, 0.85), (2.0, 0.93), (3.0, 0.70), (4.0, 0.91), (5.0, 0.92), (6.0, 0.90)]
    assert time_to_accuracy(swinging, 0.9) == 2.0  # the single crossing
    assert time_to_accuracy(swinging, 0.9, sustain=3) == 6.0  # (0.91 + 0.92 + 0.90) / 3
    assert time_to_accuracy(swinging, 0.95, sustain=3) is None
    assert time_to_accuracy(swinging[:2], 0.5, sustain=3) is None  # two validations cannot hold it
    assert accuracy_at(swinging, 3.5, sustain=3) == pytest.approx((0.85 + 0.93 + 0.70) / 3)
    assert accuracy_at(swinging, 1.5, sustain=3) == 0.85  # only one had run


def test_spread_counts_missing_values_as_the_worst() -> None:
    assert spread([3.0, 1.0, 2.0], math.inf) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([3.0, None, 2.0], math.inf) == {"median": 3.0, "min": 2.0, "max": None}
    assert spread([None, None, 2.0], math.inf) == {"median": None, "min": 2.0, "max": None}
    assert spread([1.0, 2.0, 4.0, 5.0], math.inf) == {"median": 3.0, "min": 1.0, "max": 5.0}
    assert spread([1.0, None], math.inf)["median"] is None  # even count: one of the middle two never reached
    assert spread([0.9, None, 0.8], -math.inf) == {"median": 0.8, "min": None, "max": 0.9}
    assert spread([], math.inf) == {"median": None, "min": None, "max": None}


def _report(curve: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "throughput_samples_per_s": 500.0,
        "validation_curve": curve,
        "mode_timeline": [{"mode": "sync", "step": 0}],
        "per_rank": [{"rank": 0, "batch_size": 40}, {"rank": 1, "batch_size": 24}],
    }


def test_run_results_aggregate_and_table() -> None:
    # Target 0.7: the single validation at 2.0 s crosses it, three hold it first at 3.0 s.
    ours = run_result(RunRecord("lb-bsp", Path("x"), 9.0, report=_report(CURVE)), 2, 0.7, 2.5)
    assert ours["time_to_target_s"] == 3.0 and ours["first_crossing_s"] == 2.0
    assert ours["accuracy_at_budget"] == pytest.approx((0.1 + 0.6 + 0.92) / 3)
    assert ours["last_accuracy_at_budget"] == 0.92 and ours["final_accuracy"] == 0.88
    assert ours["ok"] and ours["throughput"] == 500.0
    assert ours["modes"] == ["sync@0", "batches [40, 24] at the end"]
    docs: list[dict[str, Any]] = [
        {"rank": 0, "samples": 320, "wallSeconds": 2.0, "validationCurve": CURVE[:2]},
        {"rank": 1, "samples": 320, "wallSeconds": 4.0},
    ]
    ddp = run_result(RunRecord("ddp", Path("y"), 12.0, rank_docs=docs), 2, 0.7, 2.5)
    assert ddp["time_to_target_s"] is None and ddp["first_crossing_s"] is None
    assert ddp["accuracy_at_budget"] == pytest.approx(0.35) and ddp["last_accuracy_at_budget"] == 0.6
    assert ddp["throughput"] == pytest.approx(640 / 4.0) and ddp["modes"] == ["ddp (2 workers)"]
    decided = {"step": 19, "action": "rebalance", "predictedGain": 1.43, "reason": "measured", "applied": True}
    auto = run_result(RunRecord("auto", Path("w"), 9.0, report={**_report(CURVE), "decisions": [decided]}), 2, 0.7, 2.5)
    assert auto["modes"][1] == "rebalance@19", "a rebalance shows although the mode stays"
    # A rescale decided at step 34 and the mode the new world reports from step 36 read in step order.
    rescaled = {**_report(CURVE), "decisions": [{**decided, "step": 34, "action": "rescale"}]}
    rescaled["mode_timeline"] = [{"mode": "auto", "step": 0}, {"mode": "sync", "step": 36}]
    in_order = run_result(RunRecord("auto", Path("v"), 9.0, report=rescaled), 2, 0.7, 2.5)["modes"]
    assert in_order[:3] == ["auto@0", "rescale@34", "sync@36"], in_order
    assert auto["decisions"] == [{"step": 19, "action": "rebalance", "mode": None, "predictedGain": 1.43,
                                  "reason": "measured"}]  # fmt: skip
    failed = run_result(RunRecord("auto", Path("z"), 1.0, error="boom"), 2, 0.9, 2.5)
    assert not failed["ok"] and failed["time_to_target_s"] is None and failed["curve"] == []
    agg = aggregate([ours, ddp, ours])
    assert agg["time_to_target_s"] == {"median": 3.0, "min": 3.0, "max": None}
    assert agg["first_crossing_s"] == {"median": 2.0, "min": 2.0, "max": None}
    assert agg["reached"] == 2 and agg["seeds"] == 3 and agg["ok"]
    never = aggregate([ddp])
    table = markdown_table([{"scenario": "one-straggler", "systems": {"lb-bsp": agg, "ddp": never}}])
    lines = table.splitlines()
    assert lines[0].startswith("| scenario | system | time to target (s, mean of 3) |")
    assert lines[2].startswith(
        "| one-straggler | ddp | not reached | 0/1 | 0.350 [0.350-0.350] | not reached | 0.600 [0.600-0.600] "
        "| 160 [160-160] |"
    )
    assert lines[3].startswith("| one-straggler | lb-bsp | 3.0 [3.0-not reached] | 2/3 | 0.540 [0.350-0.540] | 2.0 [")


def test_each_seed_runs_every_system_in_a_rotated_order() -> None:
    # Over as many seeds as systems, each system takes every place in the order once: none always
    # runs first (or last) on a machine whose speed drifts through a scenario.
    orders = [run_order(SYSTEMS, i) for i in range(len(SYSTEMS))]
    assert all(sorted(o) == sorted(SYSTEMS) for o in orders)
    for place in range(len(SYSTEMS)):
        assert sorted(o[place] for o in orders) == sorted(SYSTEMS)
    assert orders[0] == list(SYSTEMS)
    assert [o[0] for o in orders[:3]] == list(SYSTEMS[:3])


def test_ddp_drop_and_lb_bsp_setups() -> None:
    cfg = BenchConfig(workers=4, steps=100, batch_size=32, learning_rate=0.1)
    one = build_scenario("one-straggler", cfg)
    batches = lb_batches(cfg, one)
    assert sum(batches.values()) == 128 and batches[3] < min(batches[r] for r in range(3))
    assert set(lb_batches(cfg, build_scenario("homogeneous", cfg)).values()) == {32}
    assert slowest_rank(cfg, one) == 3
    assert slowest_rank(CONFIG, build_scenario("transient", CONFIG)) == 3  # equal over the run: the last
    small_cfg, small = without_rank(cfg, one, 3)
    assert small_cfg.workers == 3 and small_cfg.learning_rate == pytest.approx(0.075) and small.slowdowns == ()
    bimodal = build_scenario("bimodal", cfg)
    _, rest = without_rank(cfg, bimodal, 2)
    assert [s["rank"] for s in rest.slowdowns] == [2]  # rank 3 is now rank 2, still 2x slower
    inter = build_scenario("intermittent", cfg)
    assert [rank_factor(inter.slowdowns, 3, s) for s in (0, 25, 49, 50, 75, 99)] == [1.0, 3.0, 3.0, 1.0, 3.0, 3.0]
    for name in GOODPUT_SCENARIOS:
        job = validate_job(job_doc(CONFIG, build_scenario(name, CONFIG), "auto"))
        evaluation = job.spec.training.evaluation
        # Every system validates every 5 of rank 0's steps, so one configuration validates the same models.
        assert job.spec.training.model == "digits-mlp"
        assert (evaluation.every_steps, evaluation.every_seconds) == (5, None)
    # --validate-every-steps / --validate-every-seconds: the schedule changes, the sample count stays.
    for cfg, schedule in ((step_aligned(CONFIG, 10), (10, None)), (time_aligned(CONFIG, 0.5), (None, 0.5))):
        evaluation = validate_job(job_doc(cfg, build_scenario("homogeneous", cfg), "auto")).spec.training.evaluation
        assert (evaluation.every_steps, evaluation.every_seconds, evaluation.samples) == (*schedule, 256)
    with pytest.raises(ValueError, match="at least 1"):
        step_aligned(CONFIG, 0)
    with pytest.raises(ValueError, match="positive"):
        time_aligned(CONFIG, 0.0)


@pytest.mark.multiproc
def test_tiny_goodput_run_of_every_system(tmp_path: Path) -> None:
    """2 workers, a few steps, one scenario, all seven systems: the output files and their shape."""
    from bench.goodput import main

    out = tmp_path / "goodput"
    argv = "--task digits-mlp --workers 2 --steps 60 --compute-seconds 0.02 --scenarios one-straggler --seeds 1"
    code = main([*argv.split(), "--budget", "1.0", "--target", "0.3", "--timeout", "240", "--out", str(out)])
    doc = json.loads((out / "goodput.json").read_text())
    assert [r["scenario"] for r in doc["results"]] == ["one-straggler"]
    systems = doc["results"][0]["systems"]
    assert set(systems) == set(SYSTEMS)
    for name, agg in systems.items():
        assert agg["ok"], (name, agg["runs"][0].get("error"))
        assert set(agg["time_to_target_s"]) == {"median", "min", "max"}
        assert agg["accuracy_at_budget"]["median"] is not None, name
        assert len(agg["runs"][0]["curve"]) >= 2, name  # the initial validation and at least one more
    assert systems["ddp-drop"]["runs"][0]["modes"] == ["ddp-drop (1 workers)"]
    assert any("batches" in m for m in systems["lb-bsp"]["runs"][0]["modes"]), systems["lb-bsp"]["runs"][0]
    meta = doc["metadata"]
    assert "EMULATED" in meta["emulation"] and meta["seeds"] == [0] and meta["target_accuracy"] == 0.3
    assert (out / "goodput-one-straggler.png").stat().st_size > 0
    assert "| one-straggler | lb-bsp |" in (out / "goodput.md").read_text()
    # The targets, checked: the one-straggler ones have their figures, the rest were not measured.
    targets = {(t["target"], t["scenario"]): t for t in doc["targets"]}
    assert targets[("time to target <= 0.55x DDP", "one-straggler")]["met"] is not None
    assert targets[("time to target <= 1.03x DDP", "homogeneous")]["met"] is None
    assert "## Targets" in (out / "goodput.md").read_text()
    assert code == 0


def test_a_task_config_names_the_task_and_its_schedule_and_ddp_drop_scales_its_rate() -> None:
    """A task preset writes `training.task` (no model, dataset or learning rate: the task's optimizer
    sets the rate) in our job and in the DDP baseline's run config alike; ddp-drop keeps the reference
    world of N so the job's lrScaling rule scales the task's rate for N-1."""
    from bench.goodput import TASKS

    cfg = TASKS["charlm"].config
    scenario = build_scenario("one-straggler", cfg)
    job = validate_job(job_doc(cfg, scenario, "auto"))
    assert job.spec.training.task == "charlm.task:build" and job.spec.training.lr_scaling.value == "sqrt"
    ddp = ddp_run_config(cfg, scenario)
    assert "learningRate" not in ddp["training"] and ddp["referenceWorldSize"] == 4
    small, _ = without_rank(cfg, scenario, 3)
    assert small.workers == 3 and ddp_run_config(small, scenario)["referenceWorldSize"] == 4
    cnn = validate_job(job_doc(TASKS["digits-cnn"].config, scenario, "auto"))
    assert cnn.spec.training.model == "digits-cnn" and cnn.spec.training.task is None


@pytest.mark.multiproc
def test_the_transformer_task_runs_under_ddp_and_ours_with_a_next_character_accuracy_curve(tmp_path: Path) -> None:
    """`--task charlm`: the DDP baseline trains the user's task (model, data, AdamW, schedule) through
    the trainer's own assembly, and both systems report validation accuracy over time."""
    from bench.goodput import main

    out = tmp_path / "charlm"
    argv = "--task charlm --workers 2 --steps 30 --scenarios one-straggler --systems ddp,auto --seeds 1"
    code = main([*argv.split(), "--budget", "5", "--target", "0.05", "--timeout", "240", "--out", str(out)])
    doc = json.loads((out / "goodput.json").read_text())
    systems = doc["results"][0]["systems"]
    for name in ("ddp", "auto"):
        run = systems[name]["runs"][0]
        assert run["ok"], (name, run.get("error"))
        curve = run["curve"]
        assert len(curve) >= 2 and curve[-1][1] > curve[0][1], (name, curve)  # it learned to predict characters
    assert doc["metadata"]["config"]["task"] == "charlm.task:build"
    assert code == 0


def test_real_cpu_limits_follow_the_scenarios_factors_and_refuse_changing_ones() -> None:
    from bench.real_cpu import rank_limits

    cfg = BenchConfig(workers=3, steps=40, real_cpu=0.9)
    assert rank_limits(cfg, build_scenario("one-straggler", cfg), 0.9) == pytest.approx(
        {"rank-0": 0.9, "rank-1": 0.9, "rank-2": 0.3}
    )
    assert job_doc(cfg, build_scenario("one-straggler", cfg), "sync")["spec"]["training"]["emulation"] == {
        "computeSeconds": 0.0,
        "jitter": 0.0,
        "slowdowns": [],
    }, "no sleep under real quotas"
    with pytest.raises(ValueError, match="changes rank"):
        rank_limits(cfg, build_scenario("intermittent", cfg), 0.9)


@pytest.mark.multiproc
@pytest.mark.skipif(os.geteuid() != 0 or detect() is None, reason="needs root and a cgroup cpu controller")
def test_tiny_goodput_run_under_real_cpu_quotas(tmp_path: Path) -> None:
    """--real-cpu: DDP and sync on one-straggler with real per-rank quotas (no sleep) start, finish and
    say so; the groups are gone afterwards."""
    from bench.goodput import main

    hierarchy = detect()
    assert hierarchy is not None
    out = tmp_path / "goodput"
    argv = "--task digits-mlp --workers 2 --steps 20 --scenarios one-straggler --systems ddp,sync --real-cpu 1"
    main([*argv.split(), "--seeds", "1", "--budget", "1.0", "--target", "0.3", "--timeout", "240", "--out", str(out)])
    doc = json.loads((out / "goodput.json").read_text())
    systems = doc["results"][0]["systems"]
    for name, agg in systems.items():
        assert agg["ok"], (name, agg["runs"][0].get("error"))
    assert "REAL compute" in doc["metadata"]["emulation"] and "REAL" in (out / "goodput.md").read_text()
    assert doc["results"][0]["emulation"]["computeSeconds"] == 0.0
    assert not [p for p in hierarchy.base.iterdir() if p.name.startswith(f"sgdjob-{os.getpid()}-")]
