"""Goodput benchmark: how fast does each system reach a validation accuracy, and how good is the model
after a fixed wall-time budget, on a classification task where quality differs between modes
(`digits-mlp` on the built-in `digits` dataset), on the same EMULATED scenarios.

    python -m bench.goodput [--quick] [--task digits-mlp|digits-cnn|charlm] --out DIR

`--task charlm` trains the transformer of examples/custom-task instead (see TASKS).

Systems: plain DDP on all N workers (`ddp`), DDP on the N-1 fastest (`ddp-drop`), static
speed-proportional batches in sync (`lb-bsp`), SGDJob's static `sync`, `hierarchical`, `async`, and
`auto`. Writes DIR/goodput.json, DIR/goodput.md (also printed) and DIR/goodput-<scenario>.png, and
keeps every run's own output under DIR/runs/<scenario>/<system>/seed-<k>/. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.plot import plot_curves
from bench.results import ddp_result, sgdjob_result
from bench.scenarios import (
    GOODPUT_SCENARIOS,
    POLICY,
    BenchConfig,
    Scenario,
    build_scenario,
    emulation,
    rank_speeds,
    slowest_rank,
    without_rank,
)
from bench.systems import RunRecord, guarded, run_ddp, run_sgdjob

if TYPE_CHECKING:
    from sgdjob_operator.local.progress import ProgressFrame
    from sgdjob_operator.local.runner import LocalRun
    from sgdjob_operator.workers.scrape import ScrapeResult

SYSTEMS = ("ddp", "ddp-drop", "lb-bsp", "sync", "hierarchical", "async", "auto")
QUICK_SCENARIOS = ("homogeneous", "one-straggler")
TARGET_ACCURACY = 0.9
BUDGET_S = 8.0
CHARLM_STEPS = 300
CHARLM_TARGET = 0.40
CHARLM_BUDGET_S = 30.0
# Rank 0 validates on the held-out split (256 samples, the trainer's default) every 0.5 s of
# training, in every system: the same time resolution whatever a system's step rate.
EVALUATION: dict[str, Any] = {"everySteps": None, "everySeconds": 0.5, "samples": 256}
# Auto evaluates every half second on the digits tasks: their steps take 0.05-0.15 s, so a window
# still holds 3-10 steps per rank, and a straggler present from the start is acted on at step 6-7,
# 0.6-0.9 s into training (measured on digits-cnn; step 9-13 at 1 s). A split made from such short
# windows can be a few samples off; the policy corrects it once the speeds have summed 20 steps
# (policy.speeds). What a user sets for a job this short (the quickstart's 2 s suits longer steps).
DIGITS_POLICY: dict[str, Any] = {**POLICY, "intervalSeconds": 0.5}
CONFIG = BenchConfig(
    workers=4,
    steps=200,
    learning_rate=0.1,
    model="digits-mlp",
    dataset="digits",
    evaluation=EVALUATION,
    policy=DIGITS_POLICY,
)
FULL_SEEDS = 3


@dataclass(frozen=True, slots=True)
class GoodputTask:
    """A task the benchmark trains, sized so a full run (5 scenarios x 7 systems x 3 seeds) fits in
    90 minutes here, with the validation accuracy it must reach and the wall-time budget."""

    config: BenchConfig
    target_accuracy: float
    budget_s: float
    what: str


TASKS: dict[str, GoodputTask] = {
    "digits-mlp": GoodputTask(CONFIG, TARGET_ACCURACY, BUDGET_S, "digits-mlp on the built-in digits dataset"),
    "digits-cnn": GoodputTask(
        replace(CONFIG, model="digits-cnn"),
        TARGET_ACCURACY,
        BUDGET_S,
        "digits-cnn (two convolutions) on the built-in digits dataset",
    ),
    # The transformer of examples/custom-task (training.task "charlm.task:build"): a character-level
    # language model with AdamW and the example's warmup + cosine schedule; the accuracy is
    # next-character accuracy on its held-out files.
    "charlm": GoodputTask(
        BenchConfig(
            workers=4,
            steps=CHARLM_STEPS,
            batch_size=32,
            task="charlm.task:build",
            code_dirs=("examples/custom-task",),
            lr_scaling="sqrt",
            lr_policy={"warmupSteps": 20, "schedule": "cosine", "minFactor": 0.1},
            evaluation={"everySteps": None, "everySeconds": 2.0, "samples": 128},
        ),
        CHARLM_TARGET,
        CHARLM_BUDGET_S,
        "the charlm transformer (examples/custom-task) on Python's standard library source",
    ),
}
DEFINITIONS = {
    "time_to_target_s": (
        "seconds since that run's training start until rank 0's first validation on the held-out split "
        "at or above the target accuracy; None when no validation of the run reached it"
    ),
    "accuracy_at_budget": (
        "validation accuracy of the last validation at or before the wall-time budget (seconds since training "
        "start); a run that ended before the budget keeps its final model's accuracy"
    ),
    "throughput": (
        "applied samples of all ranks / the longest rank's training wall time (start-up excluded); only samples "
        "whose gradients were applied count (ddp-drop: the N-1 workers it runs on)"
    ),
    "aggregate": (
        "median, min and max over seeds; a seed that never reached the target counts as infinitely late "
        "(so the median is null when at least half the seeds did not reach it, and max is null when one did not)"
    ),
}

Points = list[tuple[float, float]]  # (seconds since training start, validation accuracy)


def accuracy_points(rows: Sequence[Mapping[str, Any]] | None) -> Points:
    """report.json's `validation_curve` (or the DDP baseline's `validationCurve`): the rows with an
    accuracy, as (time_s, accuracy), in time order."""
    out: Points = []
    for row in rows or []:
        t, acc = row.get("time_s"), row.get("accuracy")
        if isinstance(t, int | float) and isinstance(acc, int | float) and math.isfinite(t) and math.isfinite(acc):
            out.append((float(t), float(acc)))
    return sorted(out)


def time_to_accuracy(points: Points, target: float) -> float | None:
    """First time a validation is at or above `target`; None when none is."""
    return next((t for t, acc in points if acc >= target), None)


def accuracy_at(points: Points, budget_s: float) -> float | None:
    """The accuracy of the last validation at or before `budget_s`; None when there was none by then."""
    before = [acc for t, acc in points if t <= budget_s]
    return before[-1] if before else None


def spread(values: Sequence[float | None], missing: float) -> dict[str, float | None]:
    """Median, min and max, with None counted as `missing` (inf: never reached; -inf: no value)
    and reported as None wherever it decides the figure."""
    if not values:
        return {"median": None, "min": None, "max": None}
    xs = sorted(missing if v is None else float(v) for v in values)
    n = len(xs)
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {"median": finite(mid), "min": finite(xs[0]), "max": finite(xs[-1])}


def lb_batches(cfg: BenchConfig, scenario: Scenario) -> dict[int, int]:
    """LB-BSP's static per-rank batches: proportional to each rank's emulated speed averaged over the
    run (what a user who knows the fleet sets once), summing to the job's global batch."""
    from sgdjob_operator.policy.plans import rebalanced_batches

    total = cfg.workers * cfg.batch_size
    speeds = dict(enumerate(rank_speeds(cfg, scenario)))
    return rebalanced_batches(speeds, total, {r: total for r in speeds})


@dataclass(slots=True)
class StaticBatches:
    """A poll hook for the local runner: pushes one control command with fixed per-rank batch sizes
    to rank 0 until rank 0 reports it applied, then does nothing (no policy, no other change)."""

    batch_sizes: dict[int, int]
    applied: dict[str, Any] = field(default_factory=dict)

    async def __call__(self, run: LocalRun, results: list[ScrapeResult], snapshot: ProgressFrame) -> None:
        from sgdjob_trainer.wire.control import ControlCommand

        status = run.last_status.get(0)
        if status is None:
            return
        if status.control_epoch >= 1:
            if not self.applied:
                self.applied = {"batch_sizes": self.batch_sizes, "seen_applied_at_step": status.step}
                run.report_extra["static_batches"] = self.applied
            return
        await run.push(
            ControlCommand(epoch=1, batch_sizes=self.batch_sizes, reason="lb-bsp: static speed-proportional batches")
        )


def run_system(cfg: BenchConfig, scenario: Scenario, system: str, run_dir: Path, timeout_s: float) -> RunRecord:
    if system == "ddp":
        return guarded(system, run_dir, lambda: run_ddp(cfg, scenario, run_dir, timeout_s))
    if system == "ddp-drop":
        small_cfg, small = without_rank(cfg, scenario, slowest_rank(cfg, scenario))
        return guarded(system, run_dir, lambda: run_ddp(small_cfg, small, run_dir, timeout_s, system=system))
    if system == "lb-bsp":
        hook = StaticBatches(lb_batches(cfg, scenario))
        return guarded(
            system, run_dir, lambda: run_sgdjob(cfg, scenario, "sync", run_dir, timeout_s, system=system, on_poll=hook)
        )
    return guarded(system, run_dir, lambda: run_sgdjob(cfg, scenario, system, run_dir, timeout_s))


def run_result(record: RunRecord, workers: int, target: float, budget_s: float) -> dict[str, Any]:
    """One run's figures (pure): from the DDP baseline's rank files or from our report.json."""
    report = record.report or {}
    decisions = [d for d in report.get("decisions") or [] if isinstance(d, Mapping)]
    if record.rank_docs:
        base = ddp_result(record.rank_docs, 0.0, 0.0, workers)
        rank0 = next((d for d in record.rank_docs if d.get("rank") == 0), {})
        points = accuracy_points(rank0.get("validationCurve"))
        modes = [f"{record.system} ({len(record.rank_docs)} workers)"]
    elif record.report is not None:
        base = sgdjob_result(record.report, 0.0, 0.0)
        points = accuracy_points(record.report.get("validation_curve"))
        modes = list(base["modes"])
        # Mode switches are in the timeline already; a rebalance or a resize is not.
        modes.extend(f"{d.get('action')}@{d.get('step')}" for d in decisions if d.get("action") != "switchMode")
        static = record.report.get("static_batches")
        if isinstance(static, Mapping):
            modes.append(
                f"batches {static.get('batch_sizes')} seen applied at step {static.get('seen_applied_at_step')}"
            )
    else:
        base, points, modes = {"ok": False}, [], []
    ok = bool(base.get("ok")) and record.error is None
    return {
        "time_to_target_s": time_to_accuracy(points, target),
        "accuracy_at_budget": accuracy_at(points, budget_s),
        "final_accuracy": points[-1][1] if points else None,
        "throughput": base.get("throughput"),
        "wall_s": base.get("wall_s"),
        "harness_s": record.harness_s,
        "modes": modes,
        # What the policy did and why: each decision's step, action, predicted gain and reason
        # (which names the statistical efficiency it rested on: measured or assumed).
        "decisions": [{k: d.get(k) for k in ("step", "action", "mode", "predictedGain", "reason")} for d in decisions],
        "ok": ok,
        "error": record.error,
        "curve": points,
    }


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system's figures over seeds (pure)."""
    return {
        "time_to_target_s": spread([r["time_to_target_s"] for r in runs], math.inf),
        "accuracy_at_budget": spread([r["accuracy_at_budget"] for r in runs], -math.inf),
        "throughput": spread([r["throughput"] for r in runs], -math.inf),
        "reached": sum(r["time_to_target_s"] is not None for r in runs),
        "seeds": len(runs),
        "ok": all(r["ok"] for r in runs),
        "runs": list(runs),
    }


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) and not isinstance(value, bool) else "—"


def _cell(s: Mapping[str, Any], spec: str, none: str = "—") -> str:
    if s["median"] is None and s["min"] is None:
        return none
    median = _fmt(s["median"], spec) if s["median"] is not None else none
    return f"{median} [{_fmt(s['min'], spec)}-{_fmt(s['max'], spec) if s['max'] is not None else none}]"


def markdown_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per scenario and system: median [min-max] over seeds (pure)."""
    lines = [
        "| scenario | system | time to target (s) | reached | accuracy at budget | throughput (samples/s) | modes |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for system in SYSTEMS:
            s = r["systems"].get(system)
            if s is None:
                continue
            modes = "; ".join(sorted({", ".join(run["modes"]) or "—" for run in s["runs"]}))
            errors = [run["error"] for run in s["runs"] if run.get("error")]
            lines.append(
                f"| {r['scenario']} | {system} | {_cell(s['time_to_target_s'], '.1f', 'not reached')} "
                f"| {s['reached']}/{s['seeds']} | {_cell(s['accuracy_at_budget'], '.3f')} "
                f"| {_cell(s['throughput'], '.0f')} | {'ERROR ' + errors[0] if errors else modes} |"
            )
    return "\n".join(lines) + "\n"


def run_benchmark(
    cfg: BenchConfig,
    scenarios: Sequence[str],
    systems: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    *,
    target: float,
    budget_s: float,
    timeout_s: float,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    from bench.heterogeneity import machine

    out.mkdir(parents=True, exist_ok=True)
    started, wall0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    meta_machine = machine()
    results: list[dict[str, Any]] = []
    for name in scenarios:
        scenario = build_scenario(name, cfg)
        per_system: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for seed in seeds:
            seeded = replace(cfg, seed=seed)
            for system in systems:
                print(f"[{time.monotonic() - wall0:6.0f}s] {name}: {system} seed {seed} ...", file=log, flush=True)
                record = run_system(seeded, scenario, system, out / "runs" / name / system / f"seed-{seed}", timeout_s)
                workers = cfg.workers - 1 if system == "ddp-drop" else cfg.workers
                result = run_result(record, workers, target, budget_s)
                per_system[system].append(result)
                print(
                    f"         time to target {_fmt(result['time_to_target_s'], '.1f')}s, accuracy at budget "
                    f"{_fmt(result['accuracy_at_budget'], '.3f')}, harness {record.harness_s:.0f}s"
                    f"{', ERROR ' + str(record.error) if record.error else ''}",
                    file=log,
                    flush=True,
                )
        results.append(
            {
                "scenario": name,
                "description": scenario.description,
                "emulation": emulation(cfg, scenario),
                "rank_speeds": rank_speeds(cfg, scenario),
                "lb_bsp_batches": lb_batches(cfg, scenario),
                "ddp_drop_rank": slowest_rank(cfg, scenario),
                "hierarchical_groups": [list(g) for g in scenario.groups],
                "systems": {s: aggregate(runs) for s, runs in per_system.items()},
            }
        )
    meta_machine["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    bench_wall = time.monotonic() - wall0
    runs_done = len(scenarios) * len(systems) * len(seeds)
    full_runs = len(GOODPUT_SCENARIOS) * len(SYSTEMS) * FULL_SEEDS
    return {
        "results": results,
        "metadata": {
            "date": started,
            "config": asdict(cfg),
            "seeds": list(seeds),
            "systems": list(systems),
            "target_accuracy": target,
            "budget_s": budget_s,
            "emulation": (
                "EMULATED accelerator compute (per-rank sleep per step, see each scenario's emulation); "
                "gradients computed and exchanged for real over gloo on loopback"
            ),
            "ddp_drop": (
                "DDP on the N-1 workers left after dropping the slowest (by emulated speed over the run): same batch "
                "per worker (global batch x (N-1)/N), learning rate x (N-1)/N (the job's lrScaling linear rule)"
            ),
            "lb_bsp": (
                "sgdjob sync with per-rank batch sizes proportional to emulated speed over the run "
                "(policy.plans.rebalanced_batches, same global batch), pushed once as a control command "
                "to rank 0 after it is first seen (the first steps run with equal batches)"
            ),
            "definitions": DEFINITIONS,
            "machine": meta_machine,
            "bench_wall_s": bench_wall,
            "estimated_full_run_min": bench_wall / runs_done * full_runs / 60 if runs_done else None,
        },
    }


def step_aligned(cfg: BenchConfig, every: int) -> BenchConfig:
    """`cfg` validating every `every` steps instead of on a wall-time schedule (same sample count)."""
    if every < 1:
        raise ValueError(f"--validate-every-steps must be at least 1, got {every}")
    return replace(cfg, evaluation={**(cfg.evaluation or {}), "everySteps": every, "everySeconds": None})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--quick", action="store_true", help=f"{', '.join(QUICK_SCENARIOS)}, every system, one seed (< 12 minutes)"
    )
    parser.add_argument(
        "--task", choices=sorted(TASKS), default="digits-mlp", help="what to train (default digits-mlp)"
    )
    parser.add_argument("--seeds", type=int, help=f"seeds per scenario and system (default {FULL_SEEDS}; quick 1)")
    parser.add_argument("--steps", type=int, help="override the task's steps per run")
    parser.add_argument("--workers", type=int, help=f"override the worker count (default {CONFIG.workers})")
    parser.add_argument("--compute-seconds", type=float, help="override the emulated compute seconds per step")
    parser.add_argument("--scenarios", help="comma-separated subset of scenarios")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of systems")
    parser.add_argument(
        "--target", type=float, help=f"target validation accuracy (default: the task's; digits-mlp {TARGET_ACCURACY:g})"
    )
    parser.add_argument(
        "--budget", type=float, help=f"wall-time budget, s since training start (default: the task's; {BUDGET_S:g})"
    )
    parser.add_argument(
        "--interval-seconds", type=float, help="override auto's policy.intervalSeconds (default: the task's)"
    )
    parser.add_argument(
        "--validate-every-steps",
        type=int,
        help="validate every N of rank 0's steps instead of every 0.5 s: every system then validates the same "
        "steps, so runs of one configuration show the same accuracies and differ only in speed",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one run is stopped")
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in {"steps": args.steps, "workers": args.workers, "compute_seconds": args.compute_seconds}.items()
        if v is not None
    }
    task = TASKS[args.task]
    cfg = replace(task.config, **overrides)
    if args.interval_seconds is not None:
        overrides["interval_seconds"] = args.interval_seconds
        cfg = replace(cfg, policy={**cfg.policy, "intervalSeconds": args.interval_seconds})
    if args.validate_every_steps is not None:
        overrides["validate_every_steps"] = args.validate_every_steps
        try:
            cfg = step_aligned(cfg, args.validate_every_steps)
        except ValueError as err:
            parser.error(str(err))
    target = args.target if args.target is not None else task.target_accuracy
    budget_s = args.budget if args.budget is not None else task.budget_s
    scenarios = (args.scenarios or ",".join(QUICK_SCENARIOS if args.quick else GOODPUT_SCENARIOS)).split(",")
    scenarios = [s for s in scenarios if s]
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in scenarios if s not in GOODPUT_SCENARIOS] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown scenario or system: {', '.join(unknown)}")
    seeds = list(range(args.seeds or (1 if args.quick else FULL_SEEDS)))
    wall0 = time.monotonic()
    doc = run_benchmark(
        cfg, scenarios, systems, seeds, args.out, target=target, budget_s=budget_s, timeout_s=args.timeout
    )
    meta = doc["metadata"]
    header = (
        f"# Goodput benchmark ({'quick' if args.quick else 'full'}"
        f"{' with overrides ' + str(overrides) if overrides else ''}: {task.what}, "
        f"{cfg.workers} workers, {cfg.steps} steps, {len(seeds)} seed(s), {meta['date']})\n\n"
        f"EMULATED compute: {cfg.compute_seconds:g} s/step x slowdown factor, jitter {cfg.jitter:g}; "
        "real gradients over gloo on loopback. "
        f"Machine: {meta['machine']['cpus']} CPUs, no GPU, load average {meta['machine']['load_average_at_start']} "
        f"at start. Target validation accuracy {target:g}; budget {budget_s:g} s since training start. "
        "Cells: median [min-max] over seeds. Bench wall "
        f"{meta['bench_wall_s']:.0f}s; full run estimated at {_fmt(meta['estimated_full_run_min'], '.0f')} min.\n\n"
    )
    table = markdown_table(doc["results"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "goodput.md").write_text(header + table)
    for r in doc["results"]:
        plot_curves(
            {s: [run["curve"] for run in agg["runs"]] for s, agg in r["systems"].items()},
            args.out / f"goodput-{r['scenario']}.png",
            f"{r['scenario']}: {r['description']} (EMULATED compute; {args.task}, {cfg.workers} workers, "
            f"{meta['date']})",
            target=target,
            budget_s=budget_s,
        )
    print(header + table)
    print(f"wrote {args.out / 'goodput.json'}, {args.out / 'goodput.md'} and one PNG per scenario")
    print(f"wall time {time.monotonic() - wall0:.0f}s")
    return 0 if all(s["ok"] for r in doc["results"] for s in r["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
