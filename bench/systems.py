"""Starting one system on one scenario: the DDP baseline under torchrun, or our trainer through the
local runner (`sgdjob run`'s engine, `run_local`), each in its own output directory.

Runs are strictly one after the other: the machine's cores are the shared resource being measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from bench.scenarios import BenchConfig, Scenario, ddp_run_config, job_doc

if TYPE_CHECKING:
    from sgdjob_operator.local.runner import PollHook, RunOutcome

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class RunRecord:
    """What one run left: the rank files (DDP) or the report (ours), and the harness's own clock
    (process start-up and shutdown included, unlike the throughput)."""

    system: str
    out_dir: Path
    harness_s: float
    report: dict[str, Any] | None = None
    rank_docs: list[dict[str, Any]] | None = None
    error: str | None = None


def guarded(system: str, out_dir: Path, run: Callable[[], RunRecord]) -> RunRecord:
    """`run()`, or a failed record: one broken run must not lose the others' numbers."""
    try:
        return run()
    except Exception as err:
        return RunRecord(system, out_dir, 0.0, error=f"{type(err).__name__}: {err}")


def code_paths(cfg: BenchConfig) -> tuple[str, ...]:
    """The task's code folders, absolute (the same on every system's PYTHONPATH)."""
    return tuple(str(REPO_ROOT / d) for d in cfg.code_dirs)


def run_ddp(cfg: BenchConfig, scenario: Scenario, out_dir: Path, timeout_s: float, *, system: str = "ddp") -> RunRecord:
    """`torchrun --standalone --nproc-per-node=N -m bench.ddp_baseline --config run-config.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank-*.json"):
        stale.unlink()
    config = out_dir / "run-config.json"
    config.write_text(json.dumps(ddp_run_config(cfg, scenario), indent=2) + "\n")
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.workers}",
        "-m",
        "bench.ddp_baseline" if cfg.real_cpu is None else "bench.real_cpu",  # real_cpu: joins, then runs it
        "--config",
        str(config),
    ]
    paths = (str(REPO_ROOT), *code_paths(cfg), os.environ.get("PYTHONPATH", ""))
    env = {**os.environ, "SGDJOB_REPORT_DIR": str(out_dir), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    start = time.monotonic()
    with (out_dir / "torchrun.log").open("w") as log:
        try:
            proc = subprocess.run(
                argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            )
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    harness = time.monotonic() - start
    docs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank-*.json"))]
    error = None
    if code is None:
        error = f"timed out after {timeout_s:.0f}s (log: {out_dir / 'torchrun.log'})"
    elif code != 0:
        error = f"torchrun exited with {code} (log: {out_dir / 'torchrun.log'})"
    return RunRecord(system, out_dir, harness, rank_docs=docs, error=error)


def write_job(
    cfg: BenchConfig, scenario: Scenario, mode: str, path: Path, rank_batches: Sequence[int] | None = None
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# {'REAL CPU quotas per rank' if cfg.real_cpu is not None else 'EMULATED compute'}: {scenario.name} "
        f"({scenario.description}); written by the benchmark (bench/)\n"
        + yaml.safe_dump(job_doc(cfg, scenario, mode, rank_batches), sort_keys=False)
    )
    return path


def run_job_file(
    job_path: Path,
    mode: str,
    out_dir: Path,
    timeout_s: float,
    *,
    on_poll: PollHook | None = None,
    code_dirs: tuple[Path, ...] = (),
    trainer_module: str | None = None,
) -> tuple[RunOutcome, float]:
    """`sgdjob run JOB --mode MODE --out DIR` minus the CLI's plots, progress to DIR/progress.log;
    `code_dirs` go first on the workers' PYTHONPATH. Returns the outcome and the seconds it took."""
    from sgdjob_operator.api.validation import load_jobs
    from sgdjob_operator.local.progress import PlainDisplay
    from sgdjob_operator.local.runner import RunOptions, run_local

    job = load_jobs(job_path)[0]
    options = RunOptions(out_dir=out_dir, mode=mode, timeout_s=timeout_s, code_dirs=code_dirs)
    if trainer_module is not None:
        options = replace(options, trainer_module=trainer_module)
    start = time.monotonic()
    with (out_dir / "progress.log").open("w") as log:
        outcome = asyncio.run(run_local(job, options, PlainDisplay(stream=log, every_s=5.0), on_poll))
    return outcome, time.monotonic() - start


def run_sgdjob(
    cfg: BenchConfig,
    scenario: Scenario,
    mode: str,
    out_dir: Path,
    timeout_s: float,
    *,
    system: str | None = None,
    on_poll: PollHook | None = None,
    rank_batches: Sequence[int] | None = None,
) -> RunRecord:
    """Our trainer in `mode` (sync, hierarchical, async, or auto: the policy drives it), exactly as
    `sgdjob run JOB --mode MODE --out DIR` runs it, minus the CLI's plots. `on_poll` is the local
    runner's poll hook; `system` names the record; `rank_batches` is a static split of sync's step
    from step 0 (training.rankBatchSizes)."""
    job_path = write_job(cfg, scenario, mode, out_dir / "job.yaml", rank_batches)
    code_dirs = tuple(Path(p) for p in code_paths(cfg))
    module = None
    if cfg.real_cpu is not None:  # each worker joins its rank's CPU quota first (bench.real_cpu)
        module, code_dirs = "bench.real_cpu", (REPO_ROOT, *code_dirs)
    outcome, harness = run_job_file(
        job_path, mode, out_dir, timeout_s, on_poll=on_poll, code_dirs=code_dirs, trainer_module=module
    )
    error = None if outcome.exit_code == 0 else outcome.message.splitlines()[0]
    return RunRecord(system or mode, out_dir, harness, report=outcome.report, error=error)
