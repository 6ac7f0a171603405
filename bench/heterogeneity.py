"""Heterogeneity benchmark: plain DDP against SGDJob's sync, hierarchical, async and auto, side by
side in one run, on the same EMULATED scenarios (homogeneous, one-straggler, bimodal, transient).

    python -m bench.heterogeneity [--quick] --out DIR

Writes DIR/heterogeneity.json, DIR/heterogeneity.md (also printed) and DIR/heterogeneity.png, and
keeps every run's own output under DIR/runs/<scenario>/<system>/. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.plot import plot_results
from bench.results import (
    SMOOTH_POINTS,
    SYSTEMS,
    TARGET_MULTIPLE,
    ddp_result,
    failed_result,
    markdown_table,
    ratios,
    sgdjob_result,
    target_checks,
    target_loss,
)
from bench.scenarios import SCENARIO_NAMES, BenchConfig, Scenario, bound, build_scenario, emulation, rank_speeds
from bench.systems import RunRecord, guarded, run_ddp, run_sgdjob

FULL = BenchConfig(workers=4, steps=1200)
QUICK = BenchConfig(workers=4, steps=160)
BOUND_DEFINITION = (
    "sum over workers of steps x batch / emulated compute seconds of that worker over the run's steps, "
    "from the emulation config (not measured; real forward/backward CPU time excluded), "
    "the same for every system of a scenario"
)


def _noise_floor() -> float:
    from sgdjob_trainer.data import SYNTHETIC_NOISE_FLOOR

    return SYNTHETIC_NOISE_FLOOR


def machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": False,
        "load_average_at_start": list(load) if load else None,
    }


def run_system(cfg: BenchConfig, scenario: Scenario, system: str, out: Path, timeout_s: float) -> RunRecord:
    run_dir = out / "runs" / scenario.name / system
    if system == "ddp":
        return guarded(system, run_dir, lambda: run_ddp(cfg, scenario, run_dir, timeout_s))
    return guarded(system, run_dir, lambda: run_sgdjob(cfg, scenario, system, run_dir, timeout_s))


def result_of(record: RunRecord, cfg: BenchConfig, scenario_bound: float, target: float) -> dict[str, Any]:
    if record.system == "ddp" and record.rank_docs:
        result = ddp_result(record.rank_docs, scenario_bound, target, cfg.workers)
    elif record.report is not None:
        result = sgdjob_result(record.report, scenario_bound, target)
    else:
        return {**failed_result(record.error or "no output"), "harness_s": record.harness_s}
    result["harness_s"] = record.harness_s
    if record.error:
        result["ok"] = False
        result["error"] = record.error
    if record.report is not None and record.report.get("decisions"):
        result["decisions"] = len(record.report["decisions"])
    return result


def run_benchmark(
    cfg: BenchConfig,
    scenarios: Sequence[str],
    systems: Sequence[str],
    out: Path,
    *,
    timeout_s: float,
    quick: bool,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    target = target_loss(_noise_floor())
    started, wall0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    meta_machine = machine()
    results: list[dict[str, Any]] = []
    bounds: dict[str, float] = {}
    for name in scenarios:
        scenario = build_scenario(name, cfg)
        bounds[name] = bound(cfg, scenario)
        entry: dict[str, Any] = {
            "scenario": name,
            "description": scenario.description,
            "emulation": emulation(cfg, scenario),
            "bound": bounds[name],
            "rank_speeds": rank_speeds(cfg, scenario),
            "hierarchical_groups": [list(g) for g in scenario.groups],
            "systems": {},
        }
        for system in systems:
            print(f"[{time.monotonic() - wall0:6.0f}s] {name}: {system} ...", file=log, flush=True)
            record = run_system(cfg, scenario, system, out, timeout_s)
            result = result_of(record, cfg, bounds[name], target)
            entry["systems"][system] = result
            print(
                f"         efficiency {result.get('efficiency')}, harness {record.harness_s:.0f}s"
                f"{', ERROR ' + str(record.error) if record.error else ''}",
                file=log,
                flush=True,
            )
        entry["ratios"] = ratios(entry["systems"])
        results.append(entry)
    end_load = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta_machine["load_average_at_end"] = list(end_load) if end_load else None
    return {
        "results": results,
        "targets": target_checks(results),
        "metadata": {
            "date": started,
            "quick": quick,
            "config": asdict(cfg),
            "steps": cfg.steps,
            "workers": cfg.workers,
            "systems": list(systems),
            "emulation": (
                "EMULATED accelerator compute (per-rank sleep per step, see each scenario's emulation); "
                "real gloo exchange over loopback"
            ),
            "bound_definition": BOUND_DEFINITION,
            "target_loss": target,
            "target_definition": (
                f"{TARGET_MULTIPLE:g} x SYNTHETIC_NOISE_FLOOR ({_noise_floor():g}); rank 0's batch loss, "
                f"trailing mean of {SMOOTH_POINTS} points; seconds since training start"
            ),
            "throughput_definition": (
                "applied samples of all ranks / longest rank's training wall time (start-up excluded)"
            ),
            "machine": meta_machine,
            "bench_wall_s": time.monotonic() - wall0,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.heterogeneity", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.steps} steps per run instead of {FULL.steps} (about 8 minutes on 2 idle cores)",
    )
    parser.add_argument("--steps", type=int, help="override the steps per run")
    parser.add_argument("--workers", type=int, help=f"override the worker count (default {FULL.workers})")
    parser.add_argument("--compute-seconds", type=float, help="override the emulated compute seconds per step")
    parser.add_argument("--scenarios", default=",".join(SCENARIO_NAMES), help="comma-separated subset of scenarios")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of systems")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one run is stopped")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    overrides = {
        k: v
        for k, v in {"steps": args.steps, "workers": args.workers, "compute_seconds": args.compute_seconds}.items()
        if v is not None
    }
    cfg = replace(cfg, **overrides)
    scenarios = [s for s in args.scenarios.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIO_NAMES] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown scenario or system: {', '.join(unknown)}")
    doc = run_benchmark(cfg, scenarios, systems, args.out, timeout_s=args.timeout, quick=args.quick)
    bounds = {r["scenario"]: r["bound"] for r in doc["results"]}
    table = markdown_table(doc["results"], bounds)
    meta = doc["metadata"]
    header = (
        f"# Heterogeneity benchmark ({'quick' if args.quick else 'full'}"
        f"{' with overrides ' + str(overrides) if overrides else ''}: "
        f"{cfg.workers} workers, {cfg.steps} steps, {meta['date']})\n\n"
        f"EMULATED compute: {cfg.compute_seconds:g} s/step x slowdown factor, jitter {cfg.jitter:g}; "
        "real gloo exchange on loopback. "
        f"Machine: {meta['machine']['cpus']} CPUs, no GPU, "
        f"load average {meta['machine']['load_average_at_start']} at start, "
        f"{meta['machine']['load_average_at_end']} at end. Bench wall {meta['bench_wall_s']:.0f}s. "
        f"Target loss {meta['target_loss']:g} ({meta['target_definition']}).\n\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heterogeneity.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "heterogeneity.md").write_text(header + table)
    plot_results(
        doc["results"],
        args.out / "heterogeneity.png",
        f"SGDJob vs DDP, EMULATED heterogeneity, {cfg.workers} workers, {cfg.steps} steps ({meta['date']})",
    )
    print(header + table)
    print(f"wrote {args.out / 'heterogeneity.json'}, {args.out / 'heterogeneity.md'}, {args.out / 'heterogeneity.png'}")
    return 0 if all(s.get("ok") for r in doc["results"] for s in r["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
