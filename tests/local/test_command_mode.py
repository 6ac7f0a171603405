"""Command mode end to end: examples/ddp-script/train.py, an unmodified DDP script, run by
`sgdjob run` as the SGDJob's training.command on 2 real torchrun agents (gloo on loopback): it
finishes; it survives an agent killed mid-run (lost node: the world re-forms, the script resumes
from its checkpoint); a program that does not exist is refused before any agent starts; a script
that exits 3 at once fails the job naming exit code 3, without hanging."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sgdjob_operator.api.validation import validate_job
from sgdjob_operator.local.progress import PlainDisplay, ProgressFrame
from sgdjob_operator.local.runner import LocalRun, RunOptions, run_local
from sgdjob_operator.workers.scrape import ScrapeResult
from tests.local.example_runs import REPO, SGDJOB, processes_mentioning

pytestmark = pytest.mark.multiproc

EXAMPLE = REPO / "examples" / "ddp-script"


def _job_file(folder: Path, command: list[str], backoff_limit: int = 2) -> Path:
    """The example's job, with `command`, in `folder` (beside a copy of train.py)."""
    shutil.copy(EXAMPLE / "train.py", folder / "train.py")
    job = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    job["spec"]["training"]["command"] = command
    job["spec"]["runPolicy"]["backoffLimit"] = backoff_limit
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _sgdjob_run(job: Path, out: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SGDJOB, "run", str(job), "--out", str(out), "--timeout", str(timeout)],
                          capture_output=True, text=True, timeout=timeout + 60, cwd=out.parent)  # fmt: skip


def _logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((out / "logs").glob("local-*.log")))


def test_the_ddp_script_runs_to_completion_on_two_agents(tmp_path: Path) -> None:
    job = _job_file(tmp_path, ["python", "train.py", "--epochs", "3", "--checkpoint", "ckpt.pt"])
    proc = _sgdjob_run(job, tmp_path / "out")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "command mode: the script does not report to SGDJob; mode switches and rebalancing are off" in output
    # The script's own arguments decide its length: the start line names them, not training.steps.
    start_line = next(line for line in output.splitlines() if line.startswith("sgdjob run ddp-script:"))
    assert start_line.endswith("command: python train.py --epochs 3 --checkpoint ckpt.pt"), start_line
    logs = _logs(tmp_path / "out")
    # Both agents' workers joined one world of 2 through torchrun's env contract.
    assert "rank 0/2 restart 0: starting at epoch 0" in logs and "rank 1/2 restart 0" in logs
    assert "done: 3 epochs" in logs
    # Each line the script prints is in its agent's log once (the worker's stdout is the agent's).
    for log in sorted((tmp_path / "out" / "logs").glob("local-*.log")):
        script_lines = [ln for ln in log.read_text().splitlines() if ln.startswith(("rank ", "epoch ", "done: "))]
        assert script_lines and len(script_lines) == len(set(script_lines)), (log.name, script_lines)
    assert logs.count("done: 3 epochs") == 1
    assert (tmp_path / "ckpt.pt").exists()  # the script ran in the job file's folder
    # No trainer figures are claimed for a script that reports none.
    assert "missing rank reports" not in output and "plot:" not in output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] and report["command_mode"].startswith("command mode")


def test_a_killed_agent_does_not_fail_the_job_and_the_script_resumes(tmp_path: Path) -> None:
    command = ["python", "train.py", "--epochs", "6", "--step-seconds", "0.03", "--checkpoint", "ckpt.pt"]
    job = validate_job(yaml.safe_load(_job_file(tmp_path, command, backoff_limit=3).read_text()))
    out = tmp_path / "out"
    killed: list[int] = []

    async def kill_after_first_checkpoint(run: LocalRun, _r: list[ScrapeResult], _s: ProgressFrame) -> None:
        agents = [a for a in run.fleet.active() if a.plan.node == "local-1" and a.returncode is None]
        if not killed and agents and (tmp_path / "ckpt.pt").exists():
            os.kill(agents[0].popen.pid, signal.SIGKILL)  # a lost node, as `kill -9` from outside
            killed.append(agents[0].popen.pid)

    # The lost node comes back after 8 s: time for the survivor to re-form a world of 1 (minReplicas)
    # first, then grow back to 2 when it joins: torchrun's elastic rescale, both ways.
    options: dict[str, Any] = {"poll_interval_s": 0.5, "stop_grace_s": 3.0, "failure_grace_s": 5.0,
                               "restart_backoff_s": 8.0}  # fmt: skip
    notes = io.StringIO()
    outcome = asyncio.run(
        run_local(
            job,
            RunOptions(out_dir=out, timeout_s=180.0, work_dir=tmp_path, **options),
            PlainDisplay(stream=notes, every_s=5.0),
            on_poll=kill_after_first_checkpoint,
        )
    )
    logs = _logs(out)
    assert killed, f"the test never killed an agent: {outcome.message}"
    assert outcome.exit_code == 0, outcome.message + "\n" + notes.getvalue() + logs[-3000:]
    assert processes_mentioning(str(out)) == [], "processes of the run are left behind"
    # The world re-formed after the death (a later restart round) and training went on from the
    # checkpoint, not from epoch 0.
    resumed = [int(e) for r, e in re.findall(r"rank 0/\d restart (\d+): starting at epoch (\d+)", logs) if r != "0"]
    assert resumed and all(epoch > 0 for epoch in resumed), logs[-3000:]
    assert "done: 6 epochs" in logs
    # Rank 0's world at each start ends at 2 again. Whether the survivor's world of 1 gets as far as
    # the script's first line before the node is back depends on the machine's load (torch's import),
    # so the shrink itself is not asserted; examples/ddp-script/README.md shows a run where it trained.
    worlds = [int(w) for w in re.findall(r"rank 0/(\d+) restart \d+: starting", logs)]
    assert worlds[-1] == 2, logs[-3000:]
    deaths = outcome.report["agent_deaths"] if outcome.report else []
    assert [d["node"] for d in deaths] == ["local-1"]


def test_a_missing_program_is_refused_before_any_agent_starts(tmp_path: Path) -> None:
    job = _job_file(tmp_path, ["no-such-trainer-xyz", "--epochs", "1"])
    proc = _sgdjob_run(job, tmp_path / "out", timeout=30)
    assert proc.returncode == 2
    assert "spec.training.command[0]: 'no-such-trainer-xyz' was not found on PATH" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


def test_a_script_that_exits_at_once_fails_the_job_with_its_exit_code(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text("import sys\nprint('cannot train: no data', flush=True)\nsys.exit(3)\n")
    job = _job_file(tmp_path, ["python", "fail.py"], backoff_limit=0)
    proc = _sgdjob_run(job, tmp_path / "out", timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert re.search(r"agent local-\d exited with code 3; log: ", output), output[-3000:]
    assert "cannot train: no data" in output  # the log's tail, in the job's message
    assert processes_mentioning(str(tmp_path / "out")) == []
