"""Goodput benchmark: how fast does each system reach a validation accuracy, and how good is the model
after a fixed wall-time budget, on a classification task where quality differs between modes
(`digits-cnn` on the built-in `digits` dataset), on the same EMULATED scenarios.

    python -m bench.goodput [--quick] [--set tuning|heldout] [--task digits-cnn|digits-mlp|charlm] --out DIR

`--task digits-mlp` trains the smaller MLP, `--task charlm` the transformer of examples/custom-task
(see TASKS).

Systems: plain DDP on all N workers (`ddp`), DDP on the N-1 fastest (`ddp-drop`), static
speed-proportional batches in sync (`lb-bsp`), SGDJob's static `sync`, `hierarchical`, `async`, and
`auto` at the task's policy interval and `auto-default` at the shipping default one. `--set heldout`
runs the held-out scenarios (other worker counts and factors, a late straggler, two speed classes) on
seeds from 100 instead of the tuning set's five on seeds from 0 (bench.scenarios). Writes
DIR/goodput.json, DIR/goodput.md (also printed) and DIR/goodput-<scenario>.png, and keeps every run's
own output under DIR/runs/<scenario>/<system>/seed-<k>/. Both end with the issue's targets, checked
against the medians (bench.goodput_targets: met or not, with per-seed ratios).
See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import goodput_targets
from bench.goodput_scoring import (
    DEFINITIONS,
    SYSTEMS,
    aggregate,
    fmt_number,
    markdown_table,
    run_result,
)
from bench.plot import plot_curves
from bench.scenarios import (
    HELDOUT,
    HELDOUT_SHAPES,
    POLICY,
    SCENARIO_SETS,
    TUNING,
    BenchConfig,
    Scenario,
    build_scenario,
    emulation,
    rank_speeds,
    scenario_config,
    seeds_of,
    slowest_rank,
    without_rank,
)
from bench.systems import RunRecord, guarded, run_ddp, run_sgdjob

QUICK_SCENARIOS = ("homogeneous", "one-straggler")
# --quick with --set heldout: the two held-out scenarios closest to the tuning's, one seed.
QUICK_HELDOUT = ("3w-straggler-2x", "4w-late-straggler-3x")
TARGET_ACCURACY = 0.9
BUDGET_S = 8.0
CHARLM_STEPS = 300
CHARLM_TARGET = 0.40
CHARLM_BUDGET_S = 30.0
# Rank 0 validates on the held-out split (256 samples, the trainer's default) every 5 of its steps,
# in every system: runs of one configuration (auto while it runs plain sync, `sync`, lb-bsp's
# equal batches, DDP) then validate the very same models and differ only in speed. On a wall-time
# schedule they validated different steps, and this task's accuracy swings by up to 0.15 between
# neighbouring validations, which made the time to target of one configuration vary by 30 %
# (measured 2026-12-02; `--validate-every-seconds` restores that schedule).
EVALUATION: dict[str, Any] = {"everySteps": 5, "everySeconds": None, "samples": 256}
# Auto evaluates every half second on the digits tasks: their steps take 0.05-0.15 s, so a window
# still holds 3-10 steps per rank; a 3x straggler present from the start is split at step 2-3,
# 0.35-0.6 s into training (its first window, the gain being over +100 %: policy.splits.FAST_GAIN;
# measured on digits-cnn). A split made from such short windows can be a sample or two off; the
# policy corrects it once the speeds have summed 10 steps (policy.splits.RESPLIT_STEPS). What a
# user sets for a job this short (the quickstart's 2 s suits longer steps).
# The tuning set's policy: the policy constants fitted on benchmark runs were fitted at this interval
# (MEASURE_WAIT_STEPS at the 1 s before it; bench/README.md). `auto-default` runs the same job at the
# shipping default interval beside it.
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
    """A task the benchmark trains, sized so a full run (5 scenarios x 7 systems x 3 seeds, before
    auto-default made it 8) fits in 90 minutes here, with the validation accuracy it must reach and the
    wall-time budget."""

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
# The task of the headline figures (bench/README): the CNN's accuracy differs more between modes.
DEFAULT_TASK = "digits-cnn"


def lb_batches(cfg: BenchConfig, scenario: Scenario) -> dict[int, int]:
    """LB-BSP's static per-rank batches: proportional to each rank's emulated speed averaged over the
    run (what a user who knows the fleet sets once), summing to the job's global batch."""
    from sgdjob_operator.policy.plans import rebalanced_batches

    total = cfg.workers * cfg.batch_size
    speeds = dict(enumerate(rank_speeds(cfg, scenario)))
    return rebalanced_batches(speeds, total, {r: total for r in speeds})


def run_system(cfg: BenchConfig, scenario: Scenario, system: str, run_dir: Path, timeout_s: float) -> RunRecord:
    if cfg.real_cpu is None:
        return run_emulated_or_real(cfg, scenario, system, run_dir, timeout_s)
    from bench.real_cpu import rank_groups

    run_cfg, run_scenario = (
        without_rank(cfg, scenario, slowest_rank(cfg, scenario)) if system == "ddp-drop" else (cfg, scenario)
    )
    target = "bench.ddp_baseline" if system in ("ddp", "ddp-drop") else "sgdjob_trainer"
    with rank_groups(run_cfg, run_scenario, target):
        return run_emulated_or_real(cfg, scenario, system, run_dir, timeout_s)


def shipping_interval() -> float:
    """policy.intervalSeconds when a job does not set it (the CRD's default, api.models.PolicySpec)."""
    from sgdjob_operator.api.models import PolicySpec

    return float(PolicySpec().interval_seconds)


def at_shipping_interval(cfg: BenchConfig) -> BenchConfig:
    """`cfg` with auto's policy at the shipping default interval. Only the interval changes: the
    persistence (2 intervals) and cooldown (10 s) stay the benchmark's (shipped: 3 and 60 s), so the
    two auto rows differ by the interval alone."""
    return replace(cfg, policy={**cfg.policy, "intervalSeconds": shipping_interval()})


def run_emulated_or_real(
    cfg: BenchConfig, scenario: Scenario, system: str, run_dir: Path, timeout_s: float
) -> RunRecord:
    if system == "ddp":
        return guarded(system, run_dir, lambda: run_ddp(cfg, scenario, run_dir, timeout_s))
    if system == "ddp-drop":
        small_cfg, small = without_rank(cfg, scenario, slowest_rank(cfg, scenario))
        return guarded(system, run_dir, lambda: run_ddp(small_cfg, small, run_dir, timeout_s, system=system))
    if system == "lb-bsp":
        # In the job from step 0 (training.rankBatchSizes), as a user who knows the fleet would set it.
        split = [b for _, b in sorted(lb_batches(cfg, scenario).items())]
        return guarded(
            system,
            run_dir,
            lambda: run_sgdjob(cfg, scenario, "sync", run_dir, timeout_s, system=system, rank_batches=split),
        )
    if system == "auto-default":
        shipped = at_shipping_interval(cfg)
        return guarded(
            system, run_dir, lambda: run_sgdjob(shipped, scenario, "auto", run_dir, timeout_s, system=system)
        )
    return guarded(system, run_dir, lambda: run_sgdjob(cfg, scenario, system, run_dir, timeout_s))


def scored(record: RunRecord, workers: int, target: float, budget_s: float, log: Any) -> dict[str, Any]:
    """One run's figures (goodput_scoring.run_result), with a line of them on `log`."""
    result = run_result(record, workers, target, budget_s)
    print(
        f"         time to target {fmt_number(result['time_to_target_s'], '.1f')}s, accuracy at budget "
        f"{fmt_number(result['accuracy_at_budget'], '.3f')}, harness {record.harness_s:.0f}s"
        f"{', ERROR ' + str(record.error) if record.error else ''}",
        file=log,
        flush=True,
    )
    return result


def run_order(systems: Sequence[str], index: int) -> list[str]:
    """The systems of the `index`-th seed, rotated by one place a seed: each system runs early in some
    seeds and late in others, so a machine that drifts over a scenario's minutes (this VM's speed
    moved 2-6 % in a day) does not always favour the same system of a side-by-side comparison."""
    k = index % len(systems) if systems else 0
    return [*systems[k:], *systems[:k]]


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
    scenario_set: str = TUNING,
    overrides: dict[str, Any] | None = None,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """Every scenario x seed x system, one run at a time. A held-out scenario runs on its own config
    (`scenario_config`: its worker count and compute); `overrides` (BenchConfig fields from the
    command line) apply on top of it, so `--steps` and `--compute-seconds` still size a held-out run."""
    from bench.heterogeneity import machine

    out.mkdir(parents=True, exist_ok=True)
    started, wall0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    meta_machine = machine()
    results: list[dict[str, Any]] = []
    for name in scenarios:
        scfg = replace(scenario_config(name, cfg), **(overrides or {}))
        scenario = build_scenario(name, scfg)
        per_system: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for i, seed in enumerate(seeds):
            seeded = replace(scfg, seed=seed)
            for system in run_order(systems, i):
                print(f"[{time.monotonic() - wall0:6.0f}s] {name}: {system} seed {seed} ...", file=log, flush=True)
                record = run_system(seeded, scenario, system, out / "runs" / name / system / f"seed-{seed}", timeout_s)
                workers = scfg.workers - 1 if system == "ddp-drop" else scfg.workers
                per_system[system].append(scored(record, workers, target, budget_s, log))
        results.append(
            {
                "scenario": name,
                "set": scenario_set,
                "description": scenario.description,
                "workers": scfg.workers,
                "steps": scfg.steps,
                "emulation": emulation(scfg, scenario),
                "rank_speeds": rank_speeds(scfg, scenario),
                "lb_bsp_batches": lb_batches(scfg, scenario),
                "ddp_drop_rank": slowest_rank(scfg, scenario),
                "hierarchical_groups": [list(g) for g in scenario.groups],
                "systems": {s: aggregate(runs) for s, runs in per_system.items()},
            }
        )
    meta_machine["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    bench_wall = time.monotonic() - wall0
    runs_done = len(scenarios) * len(systems) * len(seeds)
    full_runs = len(SCENARIO_SETS[scenario_set]) * len(SYSTEMS) * FULL_SEEDS
    return {
        "results": results,
        "metadata": {
            "date": started,
            "set": scenario_set,
            "config": asdict(cfg),
            "seeds": list(seeds),
            "auto_default_interval_s": shipping_interval(),
            "run_order": "each seed runs every system of a scenario, rotated by one place a seed (run_order)",
            "systems": list(systems),
            "auto_systems": (
                f"auto: the task's policy ({cfg.policy.get('intervalSeconds')} s interval, the tuning's); "
                f"auto-default: the same at the shipping default intervalSeconds ({shipping_interval():g} s)"
            ),
            "target_accuracy": target,
            "budget_s": budget_s,
            "emulation": (
                "EMULATED accelerator compute (per-rank sleep per step, see each scenario's emulation); "
                "gradients computed and exchanged for real over gloo on loopback"
                if cfg.real_cpu is None
                else f"REAL compute, no sleep: each rank in a cgroup with a real CPU quota of {cfg.real_cpu:g} CPU "
                "over its scenario factor (bench.real_cpu); gradients over gloo on loopback"
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
    """`cfg` validating every `every` of rank 0's steps (same sample count)."""
    if every < 1:
        raise ValueError(f"--validate-every-steps must be at least 1, got {every}")
    return replace(cfg, evaluation={**(cfg.evaluation or {}), "everySteps": every, "everySeconds": None})


def time_aligned(cfg: BenchConfig, seconds: float) -> BenchConfig:
    """`cfg` validating every `seconds` of training instead (same sample count)."""
    if not seconds > 0:
        raise ValueError(f"--validate-every-seconds must be positive, got {seconds}")
    return replace(cfg, evaluation={**(cfg.evaluation or {}), "everySteps": None, "everySeconds": seconds})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{', '.join(QUICK_SCENARIOS)} (held out: {', '.join(QUICK_HELDOUT)}), every system, one seed",
    )
    parser.add_argument(
        "--set",
        dest="scenario_set",
        choices=sorted(SCENARIO_SETS),
        default=TUNING,
        help="tuning: the five scenarios every fitted policy constant was fitted on, seeds 0, 1, ...; heldout: "
        "3, 6 and 8 workers, 1.5x/2x/5x, a late straggler, seeds 100, 101, ... (default tuning)",
    )
    parser.add_argument(
        "--task", choices=sorted(TASKS), default=DEFAULT_TASK, help=f"what to train (default {DEFAULT_TASK})"
    )
    parser.add_argument("--seeds", type=int, help=f"seeds per scenario and system (default {FULL_SEEDS}; quick 1)")
    parser.add_argument("--steps", type=int, help="override the task's steps per run")
    parser.add_argument(
        "--workers", type=int, help=f"override the worker count (default {CONFIG.workers}; not with --set heldout)"
    )
    parser.add_argument("--compute-seconds", type=float, help="override the emulated compute seconds per step")
    parser.add_argument("--scenarios", help="comma-separated subset of scenarios")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of systems")
    parser.add_argument(
        "--target", type=float, help=f"target validation accuracy (default: the task's; digits {TARGET_ACCURACY:g})"
    )
    parser.add_argument(
        "--budget", type=float, help=f"wall-time budget, s since training start (default: the task's; {BUDGET_S:g})"
    )
    parser.add_argument(
        "--interval-seconds", type=float, help="override auto's policy.intervalSeconds (default: the task's)"
    )
    parser.add_argument(
        "--persistence-intervals",
        type=int,
        help="override auto's policy.persistenceIntervals (default: the task's)",
    )
    schedule = parser.add_mutually_exclusive_group()
    schedule.add_argument(
        "--validate-every-steps",
        type=int,
        help="validate every N of rank 0's steps (default: the task's; digits 5): every system validates the "
        "same steps, so runs of one configuration show the same accuracies and differ only in speed",
    )
    schedule.add_argument(
        "--validate-every-seconds",
        type=float,
        help="validate every S seconds of training instead (the digits tasks' schedule until 2026-12-02: 0.5)",
    )
    parser.add_argument(
        "--real-cpu",
        type=float,
        metavar="CPUS",
        help="real slow ranks instead of the sleep: each rank gets a real cgroup CPU quota of CPUS / its factor "
        "(needs root; homogeneous, one-straggler, bimodal)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one run is stopped")
    args = parser.parse_args(argv)
    if args.scenario_set == HELDOUT and args.workers is not None:
        parser.error("the held-out scenarios set their own worker counts; --workers is the tuning set's")
    overrides = {
        k: v
        for k, v in {"steps": args.steps, "workers": args.workers, "compute_seconds": args.compute_seconds}.items()
        if v is not None
    }
    task = TASKS[args.task]
    cfg = replace(task.config, **overrides)
    if args.real_cpu is not None:
        overrides["real_cpu"] = args.real_cpu
        cfg = replace(cfg, real_cpu=args.real_cpu)
    if args.interval_seconds is not None:
        overrides["interval_seconds"] = args.interval_seconds
        cfg = replace(cfg, policy={**cfg.policy, "intervalSeconds": args.interval_seconds})
    if args.persistence_intervals is not None:
        overrides["persistence_intervals"] = args.persistence_intervals
        cfg = replace(cfg, policy={**cfg.policy, "persistenceIntervals": args.persistence_intervals})
    try:
        if args.validate_every_steps is not None:
            overrides["validate_every_steps"] = args.validate_every_steps
            cfg = step_aligned(cfg, args.validate_every_steps)
        if args.validate_every_seconds is not None:
            overrides["validate_every_seconds"] = args.validate_every_seconds
            cfg = time_aligned(cfg, args.validate_every_seconds)
    except ValueError as err:
        parser.error(str(err))
    target = args.target if args.target is not None else task.target_accuracy
    budget_s = args.budget if args.budget is not None else task.budget_s
    known = SCENARIO_SETS[args.scenario_set]
    quick = QUICK_HELDOUT if args.scenario_set == HELDOUT else QUICK_SCENARIOS
    scenarios = (args.scenarios or ",".join(quick if args.quick else known)).split(",")
    scenarios = [s for s in scenarios if s]
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in scenarios if s not in known] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown scenario or system (set {args.scenario_set}): {', '.join(unknown)}")
    if cfg.real_cpu is not None:
        from bench.real_cpu import rank_limits

        try:
            for name in scenarios:
                scfg = scenario_config(name, cfg)
                rank_limits(scfg, build_scenario(name, scfg), cfg.real_cpu)
        except ValueError as err:
            parser.error(str(err))
    seeds = seeds_of(args.scenario_set, args.seeds or (1 if args.quick else FULL_SEEDS))
    # Held out: the command line's sizes apply over each scenario's own (its workers and compute).
    sizes = {k: v for k, v in overrides.items() if k in ("steps", "compute_seconds")}
    wall0 = time.monotonic()
    doc = run_benchmark(
        cfg,
        scenarios,
        systems,
        seeds,
        args.out,
        target=target,
        budget_s=budget_s,
        timeout_s=args.timeout,
        scenario_set=args.scenario_set,
        overrides=sizes if args.scenario_set == HELDOUT else None,
    )
    meta = doc["metadata"]
    workers = (
        ", ".join(f"{n}: {HELDOUT_SHAPES[n].workers} workers, {HELDOUT_SHAPES[n].why}" for n in scenarios)
        if args.scenario_set == HELDOUT
        else f"{cfg.workers} workers"
    )
    header = (
        f"# Goodput benchmark, {args.scenario_set} set ({'quick' if args.quick else 'full'}"
        f"{' with overrides ' + str(overrides) if overrides else ''}: {task.what}, "
        f"{workers}, {cfg.steps} steps, seeds {', '.join(map(str, seeds))}, {meta['date']})\n\n"
        + (
            f"EMULATED compute: {cfg.compute_seconds:g} s/step"
            f"{' (unless the scenario says otherwise)' if args.scenario_set == HELDOUT else ''} x slowdown factor, "
            f"jitter {cfg.jitter:g}; "
            if cfg.real_cpu is None
            else f"REAL compute under real CPU quotas ({cfg.real_cpu:g} CPU / slowdown factor per rank, no sleep); "
        )
        + "real gradients over gloo on loopback. "
        f"Machine: {meta['machine']['cpus']} CPUs, no GPU, load average {meta['machine']['load_average_at_start']} "
        f"at start. Target validation accuracy {target:g}; budget {budget_s:g} s since training start. "
        f"auto: policy interval {cfg.policy.get('intervalSeconds')} s; auto-default: {shipping_interval():g} s "
        "(the shipping default). "
        f"Cells: median [min-max] over seeds. Bench wall {meta['bench_wall_s']:.0f}s; "
        f"full run estimated at {fmt_number(meta['estimated_full_run_min'], '.0f')} min.\n\n"
    )
    checks = goodput_targets.check(doc["results"])
    doc["targets"] = goodput_targets.as_json(checks)
    table = markdown_table(doc["results"]) + "\n## Targets\n\n" + goodput_targets.markdown(checks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "goodput.md").write_text(header + table)
    compute = "EMULATED compute" if cfg.real_cpu is None else "REAL CPU quotas"
    for r in doc["results"]:
        plot_curves(
            {s: [run["curve"] for run in agg["runs"]] for s, agg in r["systems"].items()},
            args.out / f"goodput-{r['scenario']}.png",
            f"{r['scenario']}: {r['description']} ({compute}; {args.task}, {r['workers']} workers, {meta['date']})",
            target=target,
            budget_s=budget_s,
        )
    print(header + table)
    print(f"wrote {args.out / 'goodput.json'}, {args.out / 'goodput.md'} and one PNG per scenario")
    print(f"wall time {time.monotonic() - wall0:.0f}s")
    return 0 if all(s["ok"] for r in doc["results"] for s in r["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
