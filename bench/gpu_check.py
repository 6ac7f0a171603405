"""GPU check: the charlm example task (examples/custom-task) trained briefly on CUDA in every mode
(sync, hierarchical, async) and precision (fp32, bf16, fp16), each run through SGDJob's real local
launcher (`sgdjob run`'s engine, `run_local`: rendezvous store, torchrun agent, NCCL).

    python -m bench.gpu_check --out DIR [--steps N] [--workers N]

Prints tokens/s (applied samples/s x the context length, from each run's report.json) and the last
validation bits/char as a table, writes DIR/gpu_check.json, keeps each run under DIR/runs/<mode>-<precision>/,
and exits 1 when a run failed. Without a CUDA device it says so and exits 0: nothing to check.

Layout: one agent with one worker process per GPU (`nprocPerNode` = GPUs, at most --workers), so
local rank i drives GPU i; NCCL cannot put two ranks of one group on the same device, so a
one-GPU machine runs a world of one (async then still goes through its parameter-server shard).
Hierarchical gets one group per worker (periodic model averaging across GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = REPO_ROOT / "examples" / "custom-task"
TASK = "charlm.task:build"
METRIC = "charlm.task:bits_per_char"
MODES = ("sync", "hierarchical", "async")
PRECISIONS = ("fp32", "bf16", "fp16")


def no_device_reason() -> str | None:
    """Why this machine cannot run the check, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        return f"no CUDA device: torch {torch.__version__} ({'CUDA ' + built if built else 'a CPU-only build'})"
    return None


def job_doc(mode: str, precision: str, *, workers: int, steps: int, batch_size: int) -> dict[str, Any]:
    """The SGDJob one run starts: the charlm task, fixed mode, no emulation (the GPU computes)."""
    training: dict[str, Any] = {
        "task": TASK,
        "batchSize": batch_size,
        "steps": steps,
        "precision": precision,
        "lrScaling": "none",
        "lrPolicy": {"warmupSteps": max(1, steps // 10), "schedule": "cosine", "minFactor": 0.1},
        "evaluation": {"everySteps": max(1, steps // 4), "samples": 256, "metric": METRIC},
    }
    if mode == "hierarchical" and workers > 1:
        training["hierarchical"] = {"groups": [[rank] for rank in range(workers)]}
    return {
        "apiVersion": "sgdjob.dev/v1alpha1",
        "kind": "SGDJob",
        "metadata": {"name": f"gpu-check-{mode}-{precision}"},
        "spec": {
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 1,
            "nprocPerNode": workers,
            "mode": mode,
            "training": training,
        },
    }


def run_one(doc: dict[str, Any], out_dir: Path, timeout_s: float, context: int) -> dict[str, Any]:
    """One run through run_local (as `sgdjob run JOB --mode M --out DIR`, minus the plots)."""
    from bench.systems import run_job_file

    out_dir.mkdir(parents=True, exist_ok=True)
    job_path = out_dir / "job.yaml"
    job_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    # The example's folder first on the workers' PYTHONPATH, as `sgdjob run` does for the job
    # file's folder, so charlm imports.
    outcome, harness = run_job_file(job_path, doc["spec"]["mode"], out_dir, timeout_s, code_dirs=(TASK_DIR,))
    report = outcome.report or {}
    validation = report.get("validation") or {}
    curve = report.get("validation_curve") or []
    return {
        "mode": doc["spec"]["mode"],
        "precision": doc["spec"]["training"]["precision"],
        "ok": outcome.exit_code == 0,
        "error": None if outcome.exit_code == 0 else (outcome.message.splitlines() or ["failed"])[0],
        "tokens_per_s": float(report.get("throughput_samples_per_s") or 0.0) * context,
        "samples_per_s": report.get("throughput_samples_per_s"),
        "steps": report.get("steps"),
        "first_bits_per_char": curve[0].get("metric") if curve else None,
        "bits_per_char": validation.get("metric"),
        "wall_s": report.get("wall_s"),
        "harness_s": harness,
        "out_dir": str(out_dir),
    }


def failed(mode: str, precision: str, error: str) -> dict[str, Any]:
    empty = dict.fromkeys(("tokens_per_s", "samples_per_s", "steps", "first_bits_per_char", "bits_per_char", "wall_s"))
    return {"mode": mode, "precision": precision, "ok": False, "error": error, **empty}


def table(results: Sequence[dict[str, Any]]) -> str:
    def num(value: Any, spec: str) -> str:
        return format(value, spec) if isinstance(value, int | float) else "-"

    lines = [
        "| mode | precision | ok | tokens/s | bits/char first -> last | steps | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['precision']} | {'yes' if r['ok'] else 'NO: ' + str(r['error'])} "
            f"| {num(r['tokens_per_s'], ',.0f')} | {num(r['first_bits_per_char'], '.2f')} -> "
            f"{num(r['bits_per_char'], '.2f')} | {num(r['steps'], 'd')} | {num(r['wall_s'], '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=64, help="windows per step per worker")
    parser.add_argument("--workers", type=int, default=4, help="at most this many GPUs (one worker each)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset of precisions")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is stopped")
    args = parser.parse_args(argv)
    reason = no_device_reason()
    if reason is not None:
        print(f"{reason}; the GPU check needs one, nothing to do")
        return 0
    import torch

    sys.path.insert(0, str(TASK_DIR))
    from charlm.data import CONTEXT

    workers = max(1, min(args.workers, torch.cuda.device_count()))
    modes = [m for m in args.modes.split(",") if m]
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = [m for m in modes if m not in MODES] + [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"unknown mode or precision: {', '.join(unknown)}")
    results = []
    for mode in modes:
        for precision in precisions:
            print(f"{mode} {precision} ...", file=sys.stderr, flush=True)
            doc = job_doc(mode, precision, workers=workers, steps=args.steps, batch_size=args.batch_size)
            try:
                results.append(run_one(doc, args.out / "runs" / f"{mode}-{precision}", args.timeout, CONTEXT))
            except Exception as err:  # one broken run must not lose the others' figures
                results.append(failed(mode, precision, f"{type(err).__name__}: {err}"))
    header = (
        f"# GPU check: charlm ({CONTEXT}-token windows), {workers} x {torch.cuda.get_device_name(0)}, "
        f"{args.steps} steps, batch {args.batch_size} per worker, torch {torch.__version__}\n\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    doc_out = {"workers": workers, "device": torch.cuda.get_device_name(0), "steps": args.steps, "results": results}
    (args.out / "gpu_check.json").write_text(json.dumps(doc_out, indent=2) + "\n")
    print(header + table(results))
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
