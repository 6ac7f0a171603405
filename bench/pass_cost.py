"""The operator's CPU cost of one policy pass of one running job (issue #37: choose the default
`policy.intervalSeconds` from what a pass costs).

    python -m bench.pass_cost --out DIR [--workers 8] [--passes 200] [--sizes 2,8,32] [--slow-factor 2]
                              [--sample-from status,metrics]

For each job size N in `--sizes` (and `--workers`, always measured), a child process serves N
real trainer HTTP servers (`sgdjob_trainer.server.TrainerServer` over `sgdjob_trainer.telemetry.
Telemetry`, the code a worker runs; rank 0's with its control inbox), fed with plausible counters.
This process is the operator side only, and runs what `k8s.reconcile.reconcile` / `k8s.monitor.monitor`
run for a running job's policy pass, with the operator's own code, each phase timed in process CPU:

- `scrape`: `k8s.observe.observe` (aiohttp, one session with the operator's connector): every
  worker's sample from one GET /status (`--sample-from status`, the operator's way), or from its
  /metrics and then rank 0's /status (`metrics`, the way before); each source given is measured in
  turn on the same fleet sizes, and the ratios of their costs printed;
- `policy`: `unanswered`/`quiet_reason`, `first_pass_wait`, `in_flight`, `evaluate_job` (the
  driver and the policy core, the policy state round-tripped through its JSON text as it is through
  the job's ConfigMap), `record_observation`, `apply_step`, `command_to_push`, `take_policy_state`;
- `push`: `post_control` to rank 0 when a command is due (most passes: none);
- `status`: `load_status` of the stored status at the start of the pass and `dump_status` plus the
  changed-or-not comparison at its end (every reconcile pass does both).

Not included: the pass's Kubernetes API requests (GET the job and its policy ConfigMap, the cached
pod and node lists, PATCH status and the ConfigMap when they changed: their counts per pass are
reported, `status_changed` and `policy_state_changed`), the store probe, the rest of the reconcile
pass (its plan) and the event loop's scheduling of it. So the capacity figures are an upper bound on
jobs per core.

Time is virtual: pass k sees the job at k policy intervals after training began (the spec's
`policy.intervalSeconds`, default 10 s), and the workers' counters, their `training_seconds` and
`stalled_seconds` advance by exactly one interval between passes, so the policy measures as it does
in a real job while the passes run back to back. The worker model (sync: every rank waits for the
slowest of its group; async: each rank steps alone; rank N-1 `--slow-factor` slower, 5 % jitter)
only makes the counters plausible; the policy's decisions on it are reported (`decisions`), and a command it
pushes is applied by the workers at the next interval, as a trainer applies it at a step boundary.

The trainer side is measured in the child: its process CPU while it only serves (the counters are
advanced outside those windows) per request, and each GET handler's own thread CPU time.

Everything is CPU time (`time.process_time`), which a loaded machine inflates far less than wall
time; wall figures are reported for information only. Writes DIR/pass_cost.json, prints a table.

The child's fleet and its driver are in `bench.pass_cost_workers`, the job and its pass in
`bench.pass_cost_operator`; this module measures the passes and reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

import aiohttp

from bench.pass_cost_operator import CONNECTION_LIMIT, Job, PassCost, one_pass
from bench.pass_cost_workers import BATCH, SLOW_FACTOR, SPEED, Workers, serve
from sgdjob_operator.workers.scrape import SampleSource, parse_metrics

SIZES = (2, 8, 32)
INTERVALS_S = (1.0, 2.0, 5.0, 10.0)
CPU_SHARE = 0.2  # the share of one core the operator may spend on policy passes (the recommendation's rule)
FLEET_JOBS = 100  # jobs the recommendation's rule serves at CPU_SHARE (issue #37: 100 jobs x 8 workers)
WARMUP_PASSES = 3  # not counted: the first passes set up connections and the policy's first windows


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and 90th percentile, in milliseconds."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "mean": 1e3 * statistics.fmean(ordered),
        "median": 1e3 * statistics.median(ordered),
        "p90": 1e3 * p90,
    }


async def _passes(
    job: Job, workers: Workers, token: str, start: float, passes: int, warmup: int
) -> tuple[list[PassCost], list[PassCost], str]:
    """The warm-up passes, the measured ones, and rank 0's /metrics text as the last pass saw it."""
    costs: list[PassCost] = []
    interval = job.spec.policy.interval_seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTION_LIMIT)) as session:
        for k in range(warmup + passes):
            if k == warmup:
                workers.ask("reset")
            elapsed = (k + 1) * interval
            workers.ask(f"advance {elapsed!r}")
            costs.append(await one_pass(job, session, start + elapsed, token))
        async with session.get(job.endpoints[0].path("/metrics")) as resp:
            text = await resp.text()
    return costs[:warmup], costs[warmup:], text


def parse_cost(text: str, repeat: int = 200) -> float:
    """CPU seconds `parse_metrics` takes on one /metrics text: the share of the scrape that is
    Prometheus text parsing rather than HTTP."""
    start = time.process_time()
    for _ in range(repeat):
        parse_metrics(text, time=0.0)
    return (time.process_time() - start) / repeat


def measure_size(
    n: int, passes: int, warmup: int, seed: int, slow_factor: float, sample_from: SampleSource = "status"
) -> dict[str, Any]:
    """Passes of one job of n workers: the operator's CPU per phase, the trainer's per request."""
    token = secrets.token_hex(16)
    workers = Workers(n, seed, slow_factor, token)
    try:
        start = time.time()
        job = Job(n, workers.ports, start, sample_from)
        early, costs, text = asyncio.run(_passes(job, workers, token, start, passes, warmup))
        trainer = workers.ask("report")
    finally:
        workers.close()
    requests: dict[str, int] = trainer["requests"]
    handler_cpu: dict[str, float] = trainer["handler_cpu_s"]
    served = sum(requests.values())
    return {
        "workers": n,
        "sample_from": sample_from,
        "passes": len(costs),
        "interval_s": job.spec.policy.interval_seconds,
        "cpu_ms": {
            phase: summary([getattr(c, phase) for c in costs])
            for phase in ("scrape", "policy", "push", "status", "total")
        },
        "scrape_wall_ms": summary([c.scrape_wall for c in costs]),
        "parse_metrics_ms_per_worker": 1e3 * parse_cost(text),
        "evaluated": sum(c.evaluated for c in costs),
        "decisions": tally_decisions(costs),
        "warmup_decisions": tally_decisions(early),
        "pushes": sum(c.pushed for c in costs),
        "scrape_errors": sum(c.errors for c in costs),
        "status_changed": sum(c.status_changed for c in costs),
        "policy_state_changed": sum(c.policy_state_changed for c in costs),
        "final_mode": trainer["mode"],
        "final_batches": trainer["batches"],
        "trainer": {
            "requests": requests,
            "cpu_ms_per_request": 1e3 * trainer["serve_cpu_s"] / served if served else None,
            "handler_cpu_ms": {path: 1e3 * handler_cpu[path] / requests[path] for path in requests},
            "payload_bytes": trainer["payload_bytes"],
        },
        "passes_detail": [asdict(c) for c in costs],
    }


def tally_decisions(costs: Sequence[PassCost]) -> dict[str, int]:
    """Evaluated passes by what they decided (keep, held, or the action applied)."""
    out: dict[str, int] = {}
    for c in costs:
        if c.evaluated:
            out[c.decision] = out.get(c.decision, 0) + 1
    return out


def linear_fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """Least-squares cost = fixed + per_worker * N over the measured sizes (None with fewer than 2)."""
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return {"fixed_ms": my - slope * mx, "per_worker_ms": slope}


def capacity(cost_ms: float, trainer_ms: float | None) -> dict[str, Any]:
    """What a pass of `cost_ms` CPU allows: jobs per operator core at each interval (whole core and
    CPU_SHARE of it), the least interval at which FLEET_JOBS jobs fit in CPU_SHARE of a core, and the
    share of a core each worker spends answering one scrape per interval."""
    return {
        "cpu_ms_per_pass": cost_ms,
        "jobs_per_core": {f"{i:g}": 1e3 * i / cost_ms for i in INTERVALS_S},
        f"jobs_per_core_at_{CPU_SHARE:g}": {f"{i:g}": CPU_SHARE * 1e3 * i / cost_ms for i in INTERVALS_S},
        f"least_interval_s_for_{FLEET_JOBS}_jobs_at_{CPU_SHARE:g}": FLEET_JOBS * cost_ms / 1e3 / CPU_SHARE,
        "trainer_core_share": None if trainer_ms is None else {f"{i:g}": trainer_ms / 1e3 / i for i in INTERVALS_S},
    }


def run(
    out: Path,
    workers: int,
    passes: int,
    sizes: Sequence[int],
    warmup: int,
    seed: int = 0,
    slow_factor: float = SLOW_FACTOR,
    sources: Sequence[SampleSource] = ("status",),
) -> dict[str, Any]:
    """Each of `sources` on every size; the doc's sizes, fit and capacity are the first source's."""
    measured = sorted({*sizes, workers})
    load_start = os.getloadavg()
    by_source: dict[str, Any] = {}
    for source in sources:
        results: dict[str, Any] = {}
        for n in measured:
            print(f"measuring {n} workers, samples from /{source}, {warmup} + {passes} passes ...", flush=True)
            results[str(n)] = measure_size(n, passes, warmup, seed, slow_factor, source)
        # The trainer's CPU per request it answers: one a worker a pass (from /metrics, rank 0 one more).
        trainer_ms = results[str(workers)]["trainer"]["cpu_ms_per_request"]
        by_source[source] = {
            "sizes": results,
            "fit": linear_fit([(float(n), results[str(n)]["cpu_ms"]["total"]["mean"]) for n in measured]),
            "capacity": capacity(results[str(workers)]["cpu_ms"]["total"]["mean"], trainer_ms),
        }
    first = by_source[sources[0]]
    doc = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "settings": {
            "sizes": measured,
            "workers": workers,
            "passes": passes,
            "warmup": warmup,
            "seed": seed,
            "step_compute_s": BATCH / SPEED,
            "slow_factor": slow_factor,
            "sample_from": list(sources),
            "cpu_clock": "time.process_time (utime+stime of the process)",
        },
        "sizes": first["sizes"],
        "fit": first["fit"],
        "capacity": first["capacity"],
    }
    if len(sources) > 1:
        doc["sources"] = by_source
        doc["ratios"] = ratios(by_source, sources[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "pass_cost.json").write_text(json.dumps(doc, indent=1))
    for name, part in by_source.items():
        print(f"\nsamples from /{name}:")
        print(table({**doc, **part}))
    for line in ratio_lines(doc.get("ratios", {}), sources[0]):
        print(line)
    return doc


def cast_sources(sources: Sequence[str]) -> list[SampleSource]:
    """The checked names, in the order given."""
    known: dict[str, SampleSource] = {s: s for s in get_args(SampleSource)}
    return [known[s] for s in sources]


def ratios(by_source: Mapping[str, Any], base: str) -> dict[str, dict[str, float]]:
    """Per other source and size: its operator CPU per pass (the whole pass and the scrape alone) over
    `base`'s, measured side by side in one run."""
    out: dict[str, dict[str, float]] = {}
    for source, part in by_source.items():
        if source == base:
            continue
        for n, r in part["sizes"].items():
            b = by_source[base]["sizes"][n]["cpu_ms"]
            out.setdefault(source, {})[f"{n}_total"] = r["cpu_ms"]["total"]["mean"] / b["total"]["mean"]
            out[source][f"{n}_scrape"] = r["cpu_ms"]["scrape"]["mean"] / b["scrape"]["mean"]
    return out


def ratio_lines(found: Mapping[str, Mapping[str, float]], base: str) -> list[str]:
    return [
        f"/{source} over /{base}, operator CPU a pass: "
        + ", ".join(f"{key.replace('_', ' workers ')} {value:.2f}x" for key, value in figures.items())
        for source, figures in found.items()
    ]


def table(doc: Mapping[str, Any]) -> str:
    rows = [
        "| workers | scrape | policy | push | status | **total** (p90) | scrape wall (median) | trainer per request "
        "(the sample's handler) | decisions |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n, r in doc["sizes"].items():
        cpu, tr = r["cpu_ms"], r["trainer"]
        decided = ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))
        rows.append(
            f"| {n} | {cpu['scrape']['mean']:.2f} | {cpu['policy']['mean']:.2f} | {cpu['push']['mean']:.3f} | "
            f"{cpu['status']['mean']:.2f} | **{cpu['total']['mean']:.2f}** ({cpu['total']['p90']:.2f}) | "
            f"{r['scrape_wall_ms']['median']:.1f} | {tr['cpu_ms_per_request']:.2f} "
            f"({tr['handler_cpu_ms'].get('/' + r['sample_from'], math.nan):.2f}) | {decided} |"
        )
    cap = doc["capacity"]
    workers = doc["settings"]["workers"]
    share = f"jobs_per_core_at_{CPU_SHARE:g}"
    least = cap[f"least_interval_s_for_{FLEET_JOBS}_jobs_at_{CPU_SHARE:g}"]
    lines = [
        "operator CPU ms per pass of one job (mean over passes; process CPU)",
        *rows,
        "",
        f"jobs of {workers} workers per operator core ({cap['cpu_ms_per_pass']:.2f} ms a pass; "
        "the pass's API requests not included):",
        "| interval | whole core | at " + f"{CPU_SHARE:.0%} of a core |",
        "|---:|---:|---:|",
        *(f"| {i} s | {cap['jobs_per_core'][i]:.0f} | {cap[share][i]:.0f} |" for i in cap["jobs_per_core"]),
        f"least interval for {FLEET_JOBS} jobs x {workers} workers at {CPU_SHARE:.0%} of a core: {least:.2f} s",
    ]
    if doc["fit"]:
        lines.append(f"fit: {doc['fit']['fixed_ms']:.2f} ms + {doc['fit']['per_worker_ms']:.3f} ms per worker")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pass_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where pass_cost.json goes")
    parser.add_argument("--workers", type=int, default=8, help="job size the capacity figures are for (measured too)")
    parser.add_argument("--passes", type=int, default=200, help="measured passes per size")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="job sizes measured, comma-separated")
    parser.add_argument("--warmup", type=int, default=WARMUP_PASSES, help="passes before the measured ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-factor", type=float, default=SLOW_FACTOR, help="rank N-1's step time over the others'")
    parser.add_argument(
        "--sample-from",
        default="status",
        help="where the operator reads each worker's sample, comma-separated to measure side by side: status, metrics",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child: serve N workers
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.seed, args.slow_factor, sys.stdin, sys.stdout)
        return 0
    if args.out is None:
        parser.error("--out is required")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.passes < 1 or args.workers < 1 or any(n < 1 for n in sizes) or not args.slow_factor > 0:
        parser.error("--passes, --workers, --sizes and --slow-factor must be positive")
    sources = [s.strip() for s in args.sample_from.split(",") if s.strip()]
    unknown = sorted(set(sources) - set(get_args(SampleSource)))
    if unknown or not sources or len(set(sources)) != len(sources):
        given = ", ".join(unknown) or repr(args.sample_from)
        parser.error(f"--sample-from: {given}: give status and/or metrics, once each")
    run(args.out, args.workers, args.passes, sizes, args.warmup, args.seed, args.slow_factor, cast_sources(sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
