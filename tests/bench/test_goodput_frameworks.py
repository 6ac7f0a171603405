"""The framework goodput benchmark (issue #39 point 4): its pure parts (the scripts' validation files,
time to a sustained loss target, loss at the budget, the auto/torchrun ratio per seed, the table and
the job it writes) in milliseconds, and one tiny real run of the Lightning example under plain
torchrun and under `sgdjob run` (about 50 s on 2 cores)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.goodput_frameworks import (
    FRAMEWORKS,
    SLOW_RANK,
    WORKERS,
    job_doc,
    script_args,
)
from bench.goodput_frameworks_scoring import (
    ASYNC,
    AUTO,
    PLAIN,
    aggregate,
    loss_at,
    markdown_table,
    parse_validation,
    ratio,
    run_figures,
    time_to_loss,
)
from sgdjob_operator.api.validation import validate_job

VALIDATION = "\n".join(
    [
        '{"time_s": 2.0, "step": 10, "loss": 3.0}',
        '{"time_s": 1.0, "step": 5, "loss": 4.0}',  # out of order: sorted by time
        '{"time_s": 3.0, "step": 15, "loss": 1.5}',  # one dip below 2.0 is not a model that holds it
        '{"time_s": 4.0, "step": 20, "loss": 2.5}',
        '{"time_s": 5.0, "step": 25, "loss": 2.2}',
        '{"time_s": 6.0, "step": 30, "loss": 1.2}',
        '{"time_s": 7.0, "step": 35, "loss": NaN}',  # not a loss
        '{"time_s": 7.5, "step": 3',  # a run killed mid-write
        "",
    ]
)


def test_a_validation_file_becomes_a_curve_and_the_target_must_hold_over_three_validations() -> None:
    points = parse_validation(VALIDATION)
    assert [step for _, step, _ in points] == [5, 10, 15, 20, 25, 30]
    # single validation: the dip at step 15; mean of three: (2.5 + 2.2 + 1.2) / 3 <= 2.0 first at step 30
    assert time_to_loss(points, 2.0, sustain=1) == (3.0, 15)
    assert time_to_loss(points, 2.0) == (6.0, 30)
    assert time_to_loss(points, 1.0) is None
    assert loss_at(points, 4.5) == pytest.approx((3.0 + 1.5 + 2.5) / 3)
    assert loss_at(points, 0.5) is None
    figures = run_figures(points, 2.0, 4.5)
    assert figures["time_to_target_s"] == 6.0 and figures["step_at_target"] == 30
    assert figures["last_step_s"] == 6.0 and figures["final_loss"] == 1.2


def _run(seed: int, time_to_target: float | None, **extra: Any) -> dict[str, Any]:
    return {
        "seed": seed,
        "time_to_target_s": time_to_target,
        "step_at_target": 45 if time_to_target is not None else None,
        "loss_at_budget": 2.6,
        "last_step_s": 20.0,
        "harness_s": 40.0,
        "ok": True,
        "error": None,
        **extra,
    }


def test_the_ratio_is_per_seed_and_a_missed_target_counts_as_infinitely_late() -> None:
    plain = aggregate([_run(0, 10.0), _run(1, 12.0), _run(2, 20.0)])
    rebalance = {"decisions": [{"step": 2, "action": "rebalance"}], "final_batches": [20, 21, 7]}
    auto = aggregate([_run(0, 6.0, **rebalance), _run(1, None, **rebalance), _run(2, 8.0, **rebalance)])
    assert plain["time_to_target_s"] == {"median": 12.0, "min": 10.0, "max": 20.0}
    assert auto["time_to_target_s"] == {"median": 8.0, "min": 6.0, "max": None}  # the miss is the worst
    assert auto["reached"] == 2
    q = ratio({PLAIN: plain, AUTO: auto})
    assert q["of_medians"] == pytest.approx(8.0 / 12.0)
    assert q["per_seed"] == [pytest.approx(0.6), None, pytest.approx(0.4)]
    result = {"framework": "lightning", "target_loss": 2.5, "budget_s": 8.0, "systems": {PLAIN: plain, AUTO: auto}}
    table = markdown_table([{**result, "ratio": q}])
    assert "| lightning | torchrun | 12.0 [10.0-20.0] | 3/3 | 45 |" in table
    assert "| lightning | sgdjob-auto | 8.0 [6.0-not reached] | 2/3 |" in table
    assert "rebalance@2, batches 20/21/7 at the end" in table
    assert "| lightning | 2.5 | 8 | sgdjob-auto | 0.67x | 0.60, —, 0.40 |" in table
    # The plain script's async system: its own row and ratio, beside auto's.
    asy = aggregate([_run(0, 5.0), _run(1, 6.0), _run(2, 30.0)])
    both = {PLAIN: plain, AUTO: auto, ASYNC: asy}
    result = {"framework": "ddp", "target_loss": 0.5, "budget_s": 10.0, "systems": both}
    table = markdown_table([{**result, "ratio": ratio(both), "ratio_async": ratio(both, ASYNC)}])
    assert "| ddp | sgdjob-async | 6.0 [5.0-30.0] | 3/3 | 45 |" in table and "async throughout" in table
    assert "| ddp | 0.5 | 10 | sgdjob-async | 0.50x | 0.50, 0.50, 1.50 |" in table


def test_every_system_runs_the_same_script_with_the_same_straggler_and_the_job_is_valid(tmp_path: Path) -> None:
    assert [n for n, f in FRAMEWORKS.items() if ASYNC in f.systems] == ["ddp"], "the integrations refuse async"
    for framework in FRAMEWORKS.values():
        args = script_args(framework, 80, 1, tmp_path / "output")
        for mode in ("auto", "async") if ASYNC in framework.systems else ("auto",):
            assert validate_job(job_doc(framework, args, tmp_path, 1.0, mode)).spec.mode.value == mode
        doc = job_doc(framework, args, tmp_path, 1.0)
        job = validate_job(doc)
        spec = job.spec
        assert (spec.replicas, spec.nproc_per_node, spec.mode.value) == (1, WORKERS, "auto")
        assert spec.training.on_adaptation_api and spec.policy.interval_seconds == 1.0
        command = list(spec.training.command or [])
        assert command[1].endswith(framework.script) and command[2:] == args
        at = args.index("--slow-rank")
        assert args[at + 1] == str(SLOW_RANK) and "--seed" in args and args[args.index("--seed") + 1] == "1"
        assert int(args[args.index("--batch-size") + 1]) == spec.training.batch_size
    # The momentum probe's levers (bench/README, "Async's momentum"): the servers' momentum and the world.
    ddp = FRAMEWORKS["ddp"]
    probe = validate_job(job_doc(ddp, script_args(ddp, 80, 3, tmp_path), tmp_path, 1.0, "async", 4, 0.6)).spec
    assert (probe.nproc_per_node, probe.training.async_.momentum) == (4, 0.6)
    assert validate_job(job_doc(ddp, args, tmp_path, 1.0, "async")).spec.training.async_.momentum is None


@pytest.mark.multiproc
def test_a_tiny_run_rebalances_the_lightning_straggler_and_reaches_the_target_at_the_same_step_sooner(
    tmp_path: Path,
) -> None:
    """20 steps of examples/lightning under plain torchrun and under `sgdjob run`: the same losses at
    every validation (the same samples a step), the straggler's batch cut, and auto faster to the
    target and to the last step."""
    from bench.goodput_frameworks import main

    out = tmp_path / "bench"
    code = main(["--out", str(out), "--framework", "lightning", "--seeds", "1", "--steps", "20", "--target", "3.0"])
    doc = json.loads((out / "goodput-frameworks.json").read_text())
    (result,) = doc["results"]
    plain, auto = (result["systems"][s]["runs"][0] for s in (PLAIN, AUTO))
    assert plain["ok"] and auto["ok"], (plain["error"], auto["error"])
    assert [p[1] for p in plain["curve"]] == [p[1] for p in auto["curve"]] == [5, 10, 15, 20]
    for (_, _, a), (_, _, b) in zip(plain["curve"], auto["curve"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (plain["curve"], auto["curve"])
    assert plain["step_at_target"] == auto["step_at_target"] is not None
    assert any(d["action"] == "rebalance" for d in auto["decisions"]), auto["decisions"]
    batches = auto["final_batches"]
    assert sum(batches) == 48 and batches[SLOW_RANK] < min(b for r, b in enumerate(batches) if r != SLOW_RANK)
    assert auto["time_to_target_s"] < plain["time_to_target_s"]
    assert auto["last_step_s"] < plain["last_step_s"]
    assert result["ratio"]["of_medians"] < 1.0
    assert "EMULATED" in doc["metadata"]["emulation"] and "sleep" in doc["metadata"]["emulation"]
    assert "| lightning | sgdjob-auto |" in (out / "goodput-frameworks.md").read_text()
    assert code == 0
