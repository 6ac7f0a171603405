"""Framework goodput benchmark (issue #39 point 4): the Hugging Face Trainer and Lightning examples and
a plain DDP script on the adaptation API on an EMULATED persistent straggler, run as the user runs them
today (plain `torchrun --nproc-per-node=3`, equal batches) and as an SGDJob (`sgdjob run`, adaptation
api: mode auto, and for the plain script mode async too), and how soon each reaches a validation-loss
target.

    python -m bench.goodput_frameworks --out DIR [--framework hf,lightning,ddp] [--systems ...]
        [--seeds N] [--steps S]

Every system runs the same script (examples/hf-trainer/train.py, examples/lightning/train.py,
bench/adapt_script.py) with the same seed, global batch (3 x 16), steps and emulation: every rank
sleeps --sample-seconds a sample of the batch it trains on, rank 2 three times that (the scripts'
opt-in `--slow-rank`), so a smaller batch really makes it faster; real gradients over gloo on
loopback. Rank 0 validates on held-out samples every 5 of its steps and writes the curve; time is
counted from its training start. Writes DIR/goodput-frameworks.json and .md (also printed); each run's
files are under DIR/runs/<framework>/<system>/seed-<k>/. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from bench.goodput_frameworks_scoring import (
    ASYNC,
    AUTO,
    DEFINITIONS,
    PLAIN,
    SYSTEMS,
    aggregate,
    markdown_table,
    parse_validation,
    ratio,
    run_figures,
)

REPO = Path(__file__).resolve().parents[1]
WORKERS = 3
BATCH = 16  # per rank: the scripts' --batch-size and the job's batchSize
SLOW_RANK = 2
SLOW_FACTOR = 3.0
# Emulated compute a sample: rank 2 sleeps 0.24 s a step on 16 samples, the others 0.08 s. Long against
# the models' real compute on these 2 cores (about 0.09 s a step for the GPT-2, 0.01 s for Lightning's),
# short enough that 80 steps take 20-30 s.
SAMPLE_SECONDS = 0.005
STEPS = 80
VALIDATE_EVERY = 5
# Short, as for the digits tasks of bench.goodput (0.5 s there): these runs last 20-30 s, and at the
# shipping 10 s the policy would first look a third of the way in.
INTERVAL_S = 1.0
FULL_SEEDS = 3
# The plain DDP script's validation-loss target and budget (bench/adapt_script.py, chosen from plain
# torchrun runs of seed 0 as the others were).
TARGET_DDP, BUDGET_DDP = 0.6, 10.0


@dataclass(frozen=True, slots=True)
class Framework:
    """A script, the job.yaml its SGDJob starts from (both relative to the repository), the options
    it runs with here, and the validation-loss target and budget (chosen from plain torchrun runs so
    the systems reach the target around half-way)."""

    script: str
    job: str
    options: tuple[str, ...]
    target_loss: float
    budget_s: float
    what: str
    # The SGDJob systems it can run: the HF and Lightning integrations refuse async (for now).
    systems: tuple[str, ...] = (AUTO,)


FRAMEWORKS: dict[str, Framework] = {
    "hf": Framework(
        "examples/hf-trainer/train.py",
        "examples/hf-trainer/job.yaml",
        ("--val-samples", "128"),
        3.1,
        10.0,
        "transformers.Trainer: a tiny GPT-2 (2 layers, 64 wide), characters of stdlib docstrings, 1024 windows",
    ),
    "lightning": Framework(
        "examples/lightning/train.py",
        "examples/lightning/job.yaml",
        ("--samples", "8192", "--val-samples", "512"),
        2.55,
        8.0,
        "lightning.Trainer: a next-character MLP on stdlib source, 8192 positions",
    ),
    "ddp": Framework(
        "bench/adapt_script.py",
        "examples/ddp-script-adapt/job.yaml",
        (),
        TARGET_DDP,
        BUDGET_DDP,
        "a plain DDP script on the adaptation API (SGD with momentum, its own loop): an MLP fitting a "
        "teacher MLP, 8192 samples",
        (AUTO, ASYNC),
    ),
}


def emulation(workers: int) -> str:
    return (
        f"EMULATED straggler (sleep-based): every rank sleeps {SAMPLE_SECONDS:g} s per sample of the batch it "
        f"trains on, rank {SLOW_RANK} of {workers} {SLOW_FACTOR:g}x that ({SLOW_FACTOR * SAMPLE_SECONDS * BATCH:g} s "
        f"at the equal batch of {BATCH}), inside the step (HF: a forward pre-hook; Lightning: training_step), the "
        "scripts' --sample-seconds/--slow-rank/--slow-factor; the model's real compute is not slowed, so the "
        "straggler is less than 3x slower per step; real gradients over gloo on loopback"
    )


def script_args(framework: Framework, steps: int, seed: int, output_dir: Path) -> list[str]:
    """The script's arguments, the same under both systems."""
    return [
        "--max-steps", str(steps), "--batch-size", str(BATCH), "--seed", str(seed),
        "--sample-seconds", str(SAMPLE_SECONDS), "--slow-rank", str(SLOW_RANK), "--slow-factor", str(SLOW_FACTOR),
        "--validate-every", str(VALIDATE_EVERY), "--log-every", "20", "--output-dir", str(output_dir),
        *framework.options,
    ]  # fmt: skip


def job_doc(
    framework: Framework,
    args: Sequence[str],
    run_dir: Path,
    interval_s: float,
    mode: str = "auto",
    workers: int = WORKERS,
    async_momentum: float | None = None,
) -> dict[str, Any]:
    """The framework's job.yaml on one node of `workers` processes (torchrun --nproc-per-node's layout),
    in `mode` (auto at `interval_s`), running the script with `args`, with `training.async.momentum`
    where given. Its checkpoints every 100 steps, as the session's default under plain torchrun, so no
    system writes more of them."""
    doc = yaml.safe_load((REPO / framework.job).read_text())
    doc["metadata"]["name"] = f"bench-{Path(framework.job).parent.name}"
    spec = doc["spec"]
    spec.update(replicas=1, minReplicas=1, maxReplicas=1, nprocPerNode=workers, mode=mode)
    spec["policy"] = {**spec.get("policy", {}), "intervalSeconds": interval_s}
    training = spec["training"]
    training["command"] = ["python", str(REPO / framework.script), *args]
    training["batchSize"] = BATCH
    training["checkpoint"] = {"dir": str(run_dir / "checkpoints"), "intervalSteps": 100}
    if async_momentum is not None:
        training["async"] = {**training.get("async", {}), "momentum": async_momentum}
    return dict(doc)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun and SGDJob's agent set for several processes
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run_once(
    framework: Framework,
    system: str,
    seed: int,
    steps: int,
    run_dir: Path,
    timeout_s: float,
    workers: int = WORKERS,
    async_momentum: float | None = None,
) -> dict[str, Any]:
    """One run of `system` (SYSTEMS) on `workers` processes and its figures; a failure is recorded,
    not raised."""
    run_dir.mkdir(parents=True, exist_ok=True)
    output_dir = run_dir / "output"
    # An async step is one rank's batch, a sync step every rank's: async gets WORKERS x the steps (a
    # fast rank's own), about as long in wall time; the figures are times to the target, not steps.
    args = script_args(framework, steps * workers if system == ASYNC else steps, seed, output_dir)
    if system == PLAIN:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                   str(REPO / framework.script), *args]  # fmt: skip
    else:
        job = run_dir / "job.yaml"
        mode = "async" if system == ASYNC else "auto"
        job.write_text(yaml.safe_dump(job_doc(framework, args, run_dir, INTERVAL_S, mode, workers, async_momentum)))
        sgdjob = str(Path(sys.executable).parent / "sgdjob")
        command = [sgdjob, "run", str(job), "--out", str(run_dir / "sgdjob"), "--timeout", str(timeout_s)]
    t0 = time.monotonic()
    error = None
    with open(run_dir / "log.txt", "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=run_dir,
                                  timeout=timeout_s + 30).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code, error = None, f"timed out after {timeout_s + 30:.0f} s"
    harness_s = time.monotonic() - t0
    if code not in (0, None):
        error = f"exit code {code}; log {run_dir / 'log.txt'}"
    curve = output_dir / "validation.jsonl"
    points = parse_validation(curve.read_text()) if curve.exists() else []
    decisions: list[dict[str, Any]] = []
    batches: list[Any] = []
    report_path = run_dir / "sgdjob" / "report.json"
    if system != PLAIN and report_path.exists():
        report = json.loads(report_path.read_text())
        keep = ("step", "action", "predictedGain", "reason")
        decisions = [{k: d.get(k) for k in keep} for d in report.get("decisions") or []]
        batches = [r.get("batch_size") for r in report.get("per_rank") or []]
    return {
        "seed": seed,
        **run_figures(points, framework.target_loss, framework.budget_s),
        "harness_s": harness_s,
        "decisions": decisions,
        "final_batches": batches,
        "ok": error is None and bool(points),
        "error": error if error is not None or points else "no validation written",
        "curve": points,
    }


def run_benchmark(
    frameworks: dict[str, Framework],
    seeds: Sequence[int],
    steps: int,
    out: Path,
    timeout_s: float,
    log: Any = sys.stderr,
    systems: Sequence[str] = (PLAIN, AUTO),
    workers: int = WORKERS,
    async_momentum: float | None = None,
) -> dict[str, Any]:
    """Every framework x seed x system (those of `systems` the framework runs), one run at a time; the
    systems' order is reversed every other seed, so a machine that drifts does not favour one."""
    from bench.heterogeneity import machine

    started, wall0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    meta_machine = machine()
    results = []
    for name, framework in frameworks.items():
        mine = [s for s in systems if s == PLAIN or s in framework.systems]
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in mine}
        for i, seed in enumerate(seeds):
            for system in mine if i % 2 == 0 else tuple(reversed(mine)):
                print(f"[{time.monotonic() - wall0:5.0f}s] {name}: {system} seed {seed} ...", file=log, flush=True)
                where = out / "runs" / name / system / f"seed-{seed}"
                run = run_once(framework, system, seed, steps, where, timeout_s, workers, async_momentum)
                print(
                    f"        time to target {run['time_to_target_s']} s (step {run['step_at_target']}), "
                    f"loss at budget {run['loss_at_budget']}, whole run {run['harness_s']:.0f} s"
                    + (f", ERROR {run['error']}" if run["error"] else ""),
                    file=log,
                    flush=True,
                )
                runs[system].append(run)
        figures = {s: aggregate(r) for s, r in runs.items()}
        results.append(
            {
                "framework": name,
                "script": framework.script,
                "what": framework.what,
                "target_loss": framework.target_loss,
                "budget_s": framework.budget_s,
                "systems": figures,
                "ratio": ratio(figures),
                **({"ratio_async": ratio(figures, ASYNC)} if ASYNC in figures else {}),
            }
        )
    meta_machine["load_average_at_end"] = list(os.getloadavg())
    return {
        "results": results,
        "metadata": {
            "date": started,
            "commit": _commit(),
            "workers": workers,
            "batch_per_rank": BATCH,
            "global_batch": workers * BATCH,
            "async_momentum": async_momentum,
            "options": {name: list(f.options) for name, f in frameworks.items()},
            "steps": steps,
            "seeds": list(seeds),
            "validate_every_steps": VALIDATE_EVERY,
            "systems": {
                PLAIN: f"python -m torch.distributed.run --standalone --nproc-per-node={workers} train.py ...",
                AUTO: f"sgdjob run job.yaml: the example's job, 1 node x {workers}, mode auto, adaptation api, "
                f"policy.intervalSeconds {INTERVAL_S:g}",
                ASYNC: "the same job in mode async throughout (the trainer's parameter servers run the script's "
                "optimizer; the ranks draw batches from one queue)",
            },
            "emulation": emulation(workers),
            "definitions": DEFINITIONS,
            "machine": meta_machine,
            "bench_wall_s": time.monotonic() - wall0,
        },
    }


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def header(doc: dict[str, Any]) -> str:
    meta = doc["metadata"]
    return (
        f"# Framework goodput ({meta['date']}, {meta['commit']}): {meta['workers']} workers, global batch "
        f"{meta['global_batch']}, {meta['steps']} steps, seeds {', '.join(map(str, meta['seeds']))}\n\n"
        f"{meta['emulation']}. Validation every {meta['validate_every_steps']} steps on rank 0; time since its "
        f"training start. {AUTO}: {meta['systems'][AUTO]}. {ASYNC}: {meta['systems'][ASYNC]}. "
        f"Machine: {meta['machine']['cpus']} CPUs, no GPU, "
        f"load average {meta['machine']['load_average_at_start']} at start. Cells: median [min-max] over seeds. "
        f"Bench wall {meta['bench_wall_s']:.0f} s.\n\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--framework", default=",".join(FRAMEWORKS), help=f"comma-separated: {', '.join(FRAMEWORKS)}")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated: {', '.join(SYSTEMS)} (a framework runs those it can: {ASYNC} only ddp)",
    )
    parser.add_argument("--seeds", type=int, default=FULL_SEEDS, help="how many seeds, from --first-seed on")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (held-out runs: past the tuned 0-2)")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"processes on the one node (default {WORKERS})")
    parser.add_argument("--momentum", type=float, help="ddp: the script's SGD momentum (default: the script's 0.9)")
    parser.add_argument(
        "--async-momentum",
        type=float,
        help="the jobs' training.async.momentum (default: omitted, the trainer lowers the script's for async)",
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--target", type=float, help="validation-loss target for every framework (default: each its own)"
    )
    parser.add_argument("--budget", type=float, help="seconds of the loss-at-budget figure (default: each its own)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before one run is stopped")
    args = parser.parse_args(argv)
    names = [n for n in args.framework.split(",") if n]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        parser.error(f"unknown framework {', '.join(unknown) or '(none)'}; known: {', '.join(FRAMEWORKS)}")
    if args.seeds < 1 or args.steps < 1 or args.workers < SLOW_RANK + 1:
        parser.error(
            f"--seeds and --steps must be at least 1, --workers at least {SLOW_RANK + 1} (the straggler's rank)"
        )
    systems = [s for s in args.systems.split(",") if s]
    wrong = [s for s in systems if s not in SYSTEMS]
    if wrong or not systems:
        parser.error(f"unknown system {', '.join(wrong) or '(none)'}; known: {', '.join(SYSTEMS)}")
    chosen = {n: FRAMEWORKS[n] for n in names}
    if args.target is not None:
        chosen = {n: replace(f, target_loss=args.target) for n, f in chosen.items()}
    if args.budget is not None:
        chosen = {n: replace(f, budget_s=args.budget) for n, f in chosen.items()}
    if args.momentum is not None:
        chosen = {n: replace(f, options=(*f.options, "--momentum", str(args.momentum))) if n == "ddp" else f
                  for n, f in chosen.items()}  # fmt: skip
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    doc = run_benchmark(
        chosen, seeds, args.steps, args.out, args.timeout, systems=systems, workers=args.workers,
        async_momentum=args.async_momentum,
    )  # fmt: skip
    text = header(doc) + markdown_table(doc["results"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput-frameworks.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "goodput-frameworks.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'goodput-frameworks.json'} and {args.out / 'goodput-frameworks.md'}")
    return 0 if all(s["ok"] for r in doc["results"] for s in r["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
