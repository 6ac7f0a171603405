"""Helpers of the local tiers: run an example job with `sgdjob run`, edited for the test, find
processes a run left behind, and the framework examples' scenario (a rebalance, then an agreed stop)
with its checks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from sgdjob_trainer.wire.control import ControlCommand

REPO = Path(__file__).resolve().parents[2]
SGDJOB = str(Path(sys.executable).parent / "sgdjob")  # the console script of this environment

# (example file name, spec changes) -> (exit code, stdout + stderr, report or None, output dir)
RunExample = Callable[[str, dict[str, Any]], tuple[int, str, dict[str, Any] | None, Path]]


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains `text` (a run's output directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def run_example_in(tmp_path: Path, name: str, spec: dict[str, Any]) -> tuple[int, str, dict[str, Any] | None, Path]:
    job = yaml.safe_load((REPO / "examples" / name).read_text())
    _merge(job["spec"], spec)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    proc = subprocess.run(
        [SGDJOB, "run", str(path), "--out", str(out), "--timeout", "500"],
        capture_output=True,
        text=True,
        timeout=560,
        cwd=tmp_path,
    )
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, report, out


def run_polled(
    job: Any, tmp_path: Path, on_poll: Any, *, restart_backoff_s: float, log_tail: int
) -> tuple[Any, str, str]:
    """`sgdjob run`'s engine on `job` into tmp_path/out, with short timings and the poll hook `on_poll`;
    returns the outcome, every agent's log, and a context for assertion messages (the outcome's
    message, the progress lines, the logs' last `log_tail` characters). Asserts that it ended with 0
    and left no process behind."""
    import asyncio
    import io

    from sgdjob_operator.local.progress import PlainDisplay
    from sgdjob_operator.local.runner import RunOptions, run_local

    out = tmp_path / "out"
    notes = io.StringIO()
    options = RunOptions(
        out_dir=out, timeout_s=150.0, work_dir=tmp_path, poll_interval_s=0.5, stop_grace_s=3.0,
        failure_grace_s=5.0, restart_backoff_s=restart_backoff_s,
    )  # fmt: skip
    outcome = asyncio.run(run_local(job, options, PlainDisplay(stream=notes, every_s=5.0), on_poll=on_poll))
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((out / "logs").glob("local-*.log")))
    context = outcome.message + "\n" + notes.getvalue() + logs[-log_tail:]
    assert outcome.exit_code == 0, context
    assert processes_mentioning(str(out)) == [], "processes of the run are left behind"
    return outcome, logs, context


def worker_of_rank(rank: int, marker: str) -> int | None:
    """The pid of the run's python worker (train.py) of `rank` (its environment names the run's folder)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.py" in cmdline and f"RANK={rank}".encode() in env and any(marker.encode() in e for e in env):
            return int(entry)
    return None


class RebalanceThenStop:
    """The poll hook of a framework example's run: push `split` to rank 0's /control (as the policy
    would) once rank 0 is at step 5, until both ranks serve it; 15 steps later SIGTERM rank 1's worker
    once (a drained node: the session stops at the next agreed step)."""

    def __init__(self, marker: str, split: dict[int, int]) -> None:
        self.marker, self.split = marker, split
        self.applied_at: int | None = None
        self.served: dict[int, int] = {}
        self.stopped_after: int | None = None

    async def __call__(self, run: Any, _results: Any, _snap: Any) -> None:
        if self.stopped_after is not None:
            return
        statuses = run.last_status
        if self.applied_at is None:
            if 0 in statuses and statuses[0].step >= 5:
                await run.push(ControlCommand(epoch=1, batch_sizes=self.split, reason="test: rebalance"))
            if all(r in statuses and statuses[r].control_epoch == 1 for r in self.split):
                self.served = {r: statuses[r].batch_size for r in self.split}
                self.applied_at = max(statuses[r].step for r in self.split)
            return
        if 0 in statuses and statuses[0].step >= self.applied_at + 15:
            pid = worker_of_rank(1, self.marker)
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
                self.stopped_after = statuses[0].step

    def check(self, logs: str, context: str, steps: int, resumed: str) -> None:
        """Both ranks applied the split at one step, served it and trained on it (the script prints
        `rank R step S: loss L (batch B)`); the SIGTERM stopped every rank at one agreed step after a
        checkpoint; the next life resumed at exactly it (the session's line, and the framework's
        `resumed` + step), kept the split and finished the script's `steps`."""
        assert self.served == self.split, context
        sizes = ", ".join(f"{r}: {b}" for r, b in self.split.items())
        applied = re.search(rf"control epoch 1 at step (\d+): batch sizes \{{{sizes}\}} \(test: rebalance\)", logs)
        assert applied, context
        at = int(applied.group(1))
        pattern = r"rank (\d) step (\d+): loss [\d.]+ \(batch (\d+)\)"
        lines = [(int(r), int(s), int(b)) for r, s, b in re.findall(pattern, logs)]
        assert (0, 5, 16) in lines and (1, 5, 16) in lines, lines  # the equal split before
        for rank, size in self.split.items():
            assert any(r == rank and s > at + 5 and b == size for r, s, b in lines), (rank, size, at, lines)
        assert self.stopped_after is not None, context
        stops = [int(s) for s in re.findall(r"stopped at the agreed step (\d+) after a checkpoint", logs)]
        assert len(stops) == 2 and len(set(stops)) == 1, (stops, context)
        stop = stops[0]
        assert stop >= self.stopped_after
        assert re.search(rf"resumed from the checkpoint of step {stop} \(world 2 -> 2\)", logs), context
        assert f"{resumed} {stop}" in logs, context
        starts = re.findall(r"rank (\d)/2 restart (\d+): starting at step (\d+)", logs)
        expected = [("0", "0", "0"), ("0", "1", str(stop)), ("1", "0", "0"), ("1", "1", str(stop))]
        assert sorted(starts) == expected, starts
        assert any(r == 1 and s > stop and b == self.split[1] for r, s, b in lines), (stop, lines)
        assert f"done: {steps} steps" in logs, context


def example_job(example: Path, folder: Path, steps: int) -> Any:
    """`example`'s job.yaml with its train.py copied into `folder`: sync (the test pushes the rebalance
    itself), 2 replicas at least, `steps` steps with a 0.04 s sleep each, lines every 5 steps, and no
    checkpoint but the agreed stop's."""
    from sgdjob_operator.api.validation import validate_job

    shutil.copy(example / "train.py", folder / "train.py")
    doc = yaml.safe_load((example / "job.yaml").read_text())
    spec = doc["spec"]
    spec["mode"] = "sync"
    spec["minReplicas"] = 2
    spec["training"]["command"] = ["python", "train.py", "--max-steps", str(steps), "--step-seconds", "0.04",
                                   "--log-every", "5"]  # fmt: skip
    spec["training"]["checkpoint"]["intervalSteps"] = 1000
    return validate_job(doc)
