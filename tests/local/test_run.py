"""`sgdjob run` end to end: real torchrun agents on loopback, with a stand-in trainer (fast, torch-free
workers) for the runner's own behaviour and with the real trainer for each fixed mode."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from sgdjob_operator.api.validation import load_jobs
from sgdjob_operator.cli import main
from sgdjob_operator.local.procs import ProcessSet, is_alive, proc_id
from sgdjob_operator.local.progress import PlainDisplay, ProgressFrame
from sgdjob_operator.local.runner import LocalRun, RunOptions, run_local
from sgdjob_operator.workers.scrape import ScrapeResult
from sgdjob_trainer.wire.worker_status import parse_termination

HERE = Path(__file__).parent
REPO = HERE.parents[1]
STAND_IN = "sgdjob_fake_trainer"
SGDJOB = str(Path(sys.executable).parent / "sgdjob")  # the console script of this environment

pytestmark = pytest.mark.multiproc


def write_job(
    path: Path,
    *,
    replicas: int = 2,
    nproc: int = 1,
    steps: int = 10,
    mode: str = "sync",
    backoff_limit: int = 3,
    **training: Any,
) -> Path:
    spec = {"replicas": replicas, "nprocPerNode": nproc, "mode": mode, "runPolicy": {"backoffLimit": backoff_limit},
            "training": {"steps": steps, "batchSize": 8, **training}}  # fmt: skip
    path.write_text(
        yaml.safe_dump(
            {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "tiny"}, "spec": spec}
        )
    )
    return path


RUNNER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from sgdjob_operator.api.validation import load_jobs
    from sgdjob_operator.local.progress import PlainDisplay
    from sgdjob_operator.local.runner import RunOptions, run_local
    job = load_jobs(Path(sys.argv[1]))[0]
    options = RunOptions(out_dir=Path(sys.argv[2]), trainer_module=sys.argv[3], poll_interval_s=0.3, \
stop_grace_s=3.0, failure_grace_s=3.0)
    sys.exit(asyncio.run(run_local(job, options, PlainDisplay(every_s=0.0))).exit_code)
    """
)


def start_runner(job: Path, out: Path, **env: str) -> subprocess.Popen[str]:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(job), str(out), STAND_IN], env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def recorded_pids(out: Path) -> list[int]:
    pids: list[int] = []
    for path in (out / "ranks").glob("pids-*.json"):
        pids.extend(json.loads(path.read_text()).values())
    return pids


def test_stand_in_run_writes_the_report(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2, nproc=2, mode="hierarchical")
    proc = start_runner(job, tmp_path / "out", FAKE_STEPS="10")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (
        report["ok"] and report["mode"] == "hierarchical" and report["workers"] == 4 and report["missing_ranks"] == []
    )
    assert sorted(r["rank"] for r in report["per_rank"]) == [0, 1, 2, 3]
    assert sorted({r["node"] for r in report["per_rank"]}) == ["local-0", "local-1"]
    assert report["samples"] == 4 * 10 * 8 and report["steps"] == 10
    assert report["throughput_samples_per_s"] > 0 and 0 < report["efficiency"] <= 1.01
    assert report["mode_timeline"][0]["mode"] == "hierarchical" and report["exit_codes"] == {"local-0": 0, "local-1": 0}
    assert "step" in output and "all workers finished" in output
    assert not any(pid_alive(p) for p in recorded_pids(tmp_path / "out"))


def test_a_failing_worker_fails_the_run_with_its_log(tmp_path: Path) -> None:
    # No restarts allowed (runPolicy.backoffLimit 0), so the first failure is final.
    job = write_job(tmp_path / "job.yaml", replicas=2, backoff_limit=0)
    proc = start_runner(job, tmp_path / "out", FAKE_STEPS="3", FAKE_FAIL_RANK="1")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, output
    assert "the job failed" in output and "exited with code" in output and ".log" in output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] is False and "exited with code" in report["error"]
    assert not any(pid_alive(p) for p in recorded_pids(tmp_path / "out"))


@pytest.mark.parametrize(("sig", "code", "ignore_term"), [(signal.SIGTERM, 143, "0"), (signal.SIGINT, 130, "1")])
def test_signal_stops_every_process(tmp_path: Path, sig: signal.Signals, code: int, ignore_term: str) -> None:
    """SIGTERM / Ctrl-C (SIGINT) to the runner ends agents, workers and the workers' own children,
    also when the workers ignore SIGTERM (then SIGKILL after the grace period)."""
    job = write_job(tmp_path / "job.yaml", replicas=2, nproc=2)
    out = tmp_path / "out"
    proc = start_runner(job, out, FAKE_IGNORE_TERM=ignore_term)
    deadline = time.monotonic() + 180
    while len(list((out / "ranks").glob("pids-*.json"))) < 4:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
    time.sleep(0.5)
    pids = recorded_pids(out)
    assert len(set(pids)) == 2 + 4 + 4 and all(pid_alive(p) for p in pids)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, output
    assert f"stopped by {sig.name}" in output
    assert [p for p in pids if pid_alive(p)] == []
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is False and report["exit_codes"] and "stopped by" in report["error"]
    # no rank files after a stop: the report is built from the last /status of every rank
    assert report["ranks_from_last_status"] == [0, 1, 2, 3] and report["samples"] > 0 and report["wall_s"] > 0


class ClosedPipeDisplay(PlainDisplay):
    """The display of `sgdjob run job.yaml | head` once head has exited: every note fails."""

    def note(self, text: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_display_that_cannot_print_still_stops_every_process(tmp_path: Path) -> None:
    """The runner's clean-up starts with a note; its failure must not skip stopping the workers."""
    job = load_jobs(write_job(tmp_path / "job.yaml", replicas=2))[0]
    out = tmp_path / "out"
    signalled: list[bool] = []

    async def stop_once_all_run(run: LocalRun, results: list[ScrapeResult], frame: ProgressFrame) -> None:
        if not signalled and len(list((out / "ranks").glob("pids-*.json"))) == 2:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # as a user's stop: the runner's own handler takes it

    options = RunOptions(out_dir=out, trainer_module=STAND_IN, code_dirs=(HERE,), poll_interval_s=0.3,
                         stop_grace_s=3.0)  # fmt: skip
    try:
        with pytest.raises(BrokenPipeError):  # the note's error still surfaces
            asyncio.run(run_local(job, options, ClosedPipeDisplay(io.StringIO(), every_s=0.0), stop_once_all_run))
        pids = recorded_pids(out)
        assert signalled and len(set(pids)) == 2 * 3  # agent, worker and its grandchild per node
        assert [p for p in pids if pid_alive(p)] == [], "worker processes left running"
    finally:
        for pid in recorded_pids(out):  # a failed run must not leave them to the next tests
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_process_set_kills_term_ignoring_workers_and_escaped_grandchildren(tmp_path: Path) -> None:
    from sgdjob_operator.local.launch import AgentPlan
    from sgdjob_trainer.wire.launch_contract import RunConfig

    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import signal, subprocess, sys, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child = subprocess.Popen([sys.executable, "-c", "import signal, time; \
signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
                                     start_new_session=True)
            print(child.pid, flush=True)
            time.sleep(600)
            """
        )
    )
    plan = AgentPlan(
        0,
        "local-0",
        (sys.executable, str(script)),
        dict(os.environ),
        tmp_path / "c.json",
        RunConfig(),
        (0,),
        tmp_path / "agent.log",
    )
    procs = ProcessSet()
    procs.start([plan])
    deadline = time.monotonic() + 60
    while not plan.log_path.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    grandchild = proc_id(int(plan.log_path.read_text().split()[0]))
    assert grandchild is not None and is_alive(grandchild)
    agent_id = procs.agents[0].id
    procs.stop(grace_s=0.5)
    assert not is_alive(agent_id) and not is_alive(grandchild)
    assert procs.agents[0].returncode == -signal.SIGKILL


def test_cli_names_the_bad_field_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "b"}, "spec": {"replicas": 0}}
        )
    )
    result = CliRunner().invoke(main, ["run", str(bad)])
    assert result.exit_code == 2 and "spec.replicas" in result.output
    result = CliRunner().invoke(main, ["run", str(bad), "--mode", "fastest"])
    assert result.exit_code == 2 and "--mode" in result.output


@pytest.mark.parametrize("mode", ["sync", "hierarchical", "async"])
def test_real_trainer_fixed_mode(tmp_path: Path, mode: str) -> None:
    """Two workers, rank 1 emulated 2x slower. The spec says auto; --mode fixes the mode for the run."""
    emulation = {"computeSeconds": 0.02, "slowdowns": [{"rank": 1, "factor": 2.0}]}
    job = write_job(tmp_path / "job.yaml", replicas=2, steps=30, mode="auto", learningRate=0.02, emulation=emulation)
    out = tmp_path / "out"
    flags = ["--mode", mode]
    proc = subprocess.run([SGDJOB, "run", str(job), *flags, "--out", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["mode"] == mode and report["workers"] == 2 and report["missing_ranks"] == []
    assert report["mode_timeline"][0]["mode"] == mode and report["steps"] >= 1
    assert (
        report["throughput_samples_per_s"] > 0
        and report["bound_samples_per_s"] >= report["throughput_samples_per_s"] * 0.99
    )
    assert report["diverged_ranks"] == [] and report["final_loss"] < report["initial_loss"], report
    assert report["emulation"]["slowdowns"][0]["rank"] == 1
    fast, slow = sorted(report["per_rank"], key=lambda r: r["rank"])
    assert slow["speed_samples_per_s"] < fast["speed_samples_per_s"]


def test_real_trainer_survives_an_emulated_fault(tmp_path: Path) -> None:
    """Two agents (emulated nodes); rank 1 exits abruptly at step 15 on its first life. torchrun
    (--max-restarts from runPolicy.backoffLimit) restarts both workers, they resume from the
    checkpoint of step 10, and the report counts the restart and the steps redone."""
    training = {
        "emulation": {"computeSeconds": 0.01},
        "checkpoint": {"dir": "ignored", "intervalSteps": 10},
        "faults": [{"rank": 1, "atStep": 15}],
    }
    job = write_job(tmp_path / "job.yaml", replicas=2, steps=40, mode="sync", learningRate=0.02, **training)
    out = tmp_path / "out"
    proc = subprocess.run(
        [SGDJOB, "run", str(job), "--out", str(out), "--timeout", "400"],
        capture_output=True,
        text=True,
        timeout=450,
        cwd=tmp_path,
    )
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["ok"] and report["steps"] == 40 and report["restarts"] == 1, report
    assert 0 <= report["lost_steps"] <= 10 and report["resumes"][0]["fromStep"] == 10
    assert report["checkpoint"]["completed"][-1] == 40 and report["final_loss"] < report["initial_loss"] * 1.5
    assert (out / "checkpoints" / "step-0000000040" / "COMPLETE").exists()


def test_a_users_metric_hook_is_validated_reported_and_ends_the_job_at_its_target(tmp_path: Path) -> None:
    """training.evaluation.metric names the user's function; the curve carries it and a `minimize`
    target on it ends the run (error rate at or below 0.25 on digits)."""
    (tmp_path / "sgdjob_test_metric.py").write_text(
        "def error_rate(outputs, targets):\n    return (outputs.argmax(dim=1) != targets).float().mean()\n"
    )
    training = {
        "model": "digits-mlp",
        "dataset": "digits",
        "learningRate": 0.1,
        "evaluation": {"everySteps": 10, "samples": 200, "metric": "sgdjob_test_metric:error_rate"},
        "target": {"metric": "metric", "value": 0.25, "minimize": True},
    }
    job = write_job(tmp_path / "job.yaml", replicas=2, steps=5000, mode="sync", **training)
    out = tmp_path / "out"
    # As in a pod: rank 0 writes how training ended to the container's termination message file.
    termination = tmp_path / "termination-log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "SGDJOB_TERMINATION_LOG": str(termination),
    }
    proc = subprocess.run([SGDJOB, "run", str(job), "--out", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "reached the target" in output, output
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["reason"] == "TargetReached" and report["steps"] < 5000, report
    curve = report["validation_curve"]
    # The metric is the user's own figure: here exactly 1 - accuracy at every validation.
    assert all(p["metric"] == pytest.approx(1 - p["accuracy"]) for p in curve), curve
    reached = next(p for p in curve if p["step"] == report["target_step"])
    assert reached["metric"] <= 0.25 < curve[0]["metric"]
    assert report["validation"]["metric"] == pytest.approx(curve[-1]["metric"])
    ended = parse_termination(termination.read_text())
    assert ended is not None and ended.end_reason == "TargetReached" and ended.target_step == report["target_step"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_real_trainer_ends_when_the_validation_reaches_the_target(tmp_path: Path, mode: str) -> None:
    """digits-mlp on two workers with an accuracy target a short run reaches: every rank stops at an
    agreed step long before `steps`, the run succeeds, and report.json says when and why."""
    training = {
        "model": "digits-mlp",
        "dataset": "digits",
        "learningRate": 0.1,
        "evaluation": {"everySteps": 10, "samples": 200},
        "target": {"metric": "accuracy", "value": 0.8},
    }
    job = write_job(tmp_path / "job.yaml", replicas=2, steps=5000, mode=mode, **training)
    out = tmp_path / "out"
    proc = subprocess.run([SGDJOB, "run", str(job), "--out", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "reached the target" in output, output
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["reason"] == "TargetReached", report
    assert 0 < report["target_step"] <= report["steps"] < 5000 and report["time_to_target_s"] > 0
    curve = report["validation_curve"]
    assert curve[0]["step"] == 0 and curve[0]["accuracy"] < 0.8 <= max(p["accuracy"] for p in curve)
    assert [p["step"] for p in curve] == sorted(p["step"] for p in curve) and curve[-1]["samples"] > 0
    assert all(b["time_s"] >= a["time_s"] and b["samples"] >= a["samples"] for a, b in itertools.pairwise(curve))
    reached = next(p for p in curve if p["step"] == report["target_step"])
    assert reached["accuracy"] >= 0.8 and reached["time_s"] <= report["time_to_target_s"] + 0.5
    assert report["validation"]["accuracy"] is not None and report["diverged_ranks"] == []
    # Both ranks stopped at the same agreed step (sync: the same number of steps each).
    if mode == "sync":
        assert len({r["steps"] for r in report["per_rank"]}) == 1, report["per_rank"]
