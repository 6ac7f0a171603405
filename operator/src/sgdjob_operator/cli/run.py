"""`sgdjob run FILE`: run an SGDJob's workers on this machine and write a report."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import click

from sgdjob_operator.api.models import JobMode, SGDJob
from sgdjob_operator.api.validation import SpecError, load_jobs, spec_warnings, validate_job
from sgdjob_operator.local.command_mode import command_check
from sgdjob_operator.local.cpulimit import CpuLimitError, parse_cpu_limits
from sgdjob_operator.local.launch import job_name
from sgdjob_operator.local.live import RichDisplay
from sgdjob_operator.local.progress import PlainDisplay
from sgdjob_operator.local.runner import RunOptions, default_out_dir, run_local

EXIT_USAGE = 2


def _select(jobs: list[SGDJob], name: str | None, path: Path) -> SGDJob:
    if name is None:
        if len(jobs) > 1:
            names = ", ".join(job_name(j) for j in jobs)
            click.echo(f"{path}: holds {len(jobs)} SGDJobs ({names}); choose one with --job", err=True)
            sys.exit(EXIT_USAGE)
        return jobs[0]
    for job in jobs:
        if job_name(job) == name:
            return job
    click.echo(f"{path}: no SGDJob named {name!r} (found: {', '.join(job_name(j) for j in jobs)})", err=True)
    sys.exit(EXIT_USAGE)


def with_cpu_limits(job: SGDJob, limits: list[float]) -> SGDJob:
    """The job with `--cpu-limits` as its training.emulation.cpuLimits, validated like the file (so a
    wrong count names the field). A job without emulation gets one that does not sleep."""
    doc = job.model_dump(mode="json", by_alias=True)  # None kept: an explicit null may differ from the default
    training = doc["spec"].setdefault("training", {})
    if training.get("emulation") is None:
        training["emulation"] = {"computeSeconds": 0.0}
    training["emulation"]["cpuLimits"] = limits
    try:
        return validate_job(doc)
    except SpecError as err:
        raise SpecError([f"--cpu-limits: {p}" for p in err.problems]) from err


@click.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--mode",
    type=click.Choice([m.value for m in JobMode]),
    default=None,
    help="auto (the policy switches at run time) or a fixed mode; overrides spec.mode.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output directory [default: ./runs/<job>-<timestamp>].",
)
@click.option("--job", "name", default=None, help="Which SGDJob to run when FILE holds several (metadata.name).")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Stop everything after this many seconds (exit 124).",
)
@click.option(
    "--poll-interval",
    "poll_s",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between polls of the workers (an auto run polls at least once per policy.intervalSeconds).",
)
@click.option(
    "--cpu-limits",
    "cpu_limits",
    default=None,
    metavar="CPUS,...",
    help=(
        "Real slow nodes: one CPU limit per worker (agent local-0 first), e.g. 0.8,0.8,0.27, applied as a real "
        "cgroup CPU quota (needs root and the cgroup cpu controller); overrides training.emulation.cpuLimits."
    ),
)
def run(
    file: Path,
    mode: str | None,
    out_dir: Path | None,
    name: str | None,
    timeout_s: float | None,
    poll_s: float,
    cpu_limits: str | None,
) -> None:
    """Run the SGDJob in FILE as local worker processes (one torchrun agent per emulated node).

    FILE's folder goes first on the workers' PYTHONPATH, so a training.task or hook module beside
    the job file is importable. A training.command (your own torchrun script, unmodified) runs in
    FILE's folder, its leading `python` being this interpreter; the auto policy is off for it.
    Writes OUT/report.json (throughput, bound, efficiency, losses, mode timeline, decisions,
    per-rank speeds) and PNG plots. A live view on a terminal, plain lines otherwise.
    Exits 0 when every worker succeeded, 2 for a bad spec (or a command that cannot start), 130/143 when interrupted.
    """
    try:
        jobs = load_jobs(file)
    except SpecError as err:
        for problem in err.problems:
            click.echo(f"{file}: {problem}", err=True)
        sys.exit(EXIT_USAGE)
    job = _select(jobs, name, file)
    if mode is not None and mode != JobMode.SYNC.value and job.spec.training.rank_batch_sizes is not None:
        click.echo(
            f"{file}: --mode {mode}: spec.training.rankBatchSizes is a static split for mode sync; "
            "drop --mode or rankBatchSizes",
            err=True,
        )
        sys.exit(EXIT_USAGE)
    if cpu_limits is not None:
        try:
            job = with_cpu_limits(job, parse_cpu_limits(cpu_limits))
        except (ValueError, SpecError) as err:
            for problem in err.problems if isinstance(err, SpecError) else [str(err)]:
                click.echo(f"{file}: {problem}", err=True)
            sys.exit(EXIT_USAGE)
    effective = job.spec if mode is None else job.spec.model_copy(update={"mode": JobMode(mode)})
    for warning in spec_warnings(effective, mode_field="spec.mode" if mode is None else "--mode"):
        click.echo(f"{file}: warning: {warning.message}", err=True)
    command = job.spec.training.command
    if command is not None:  # before any agent starts, not after each has failed to exec it
        refused = command_check(command, file.parent.resolve(), sys.executable, os.environ.get("PATH", ""))
        if refused is not None:
            click.echo(f"{file}: {refused}", err=True)
            sys.exit(EXIT_USAGE)
    options = RunOptions(
        out_dir=out_dir or default_out_dir(job),
        mode=mode,
        poll_interval_s=poll_s,
        timeout_s=timeout_s,
        code_dirs=(file.parent,),
        work_dir=file.parent,
    )
    display = RichDisplay() if sys.stdout.isatty() else PlainDisplay()
    try:
        outcome = asyncio.run(run_local(job, options, display))
    except CpuLimitError as err:
        click.echo(f"{file}: {err}", err=True)
        sys.exit(EXIT_USAGE)
    if outcome.report is not None and outcome.report_path is not None and command is None:  # a script: no curves
        from sgdjob_operator.local.plots import write_plots  # matplotlib: only when there is a report

        for path in write_plots(outcome.report, outcome.report_path.parent):
            click.echo(f"plot: {path}")
    sys.exit(outcome.exit_code)
