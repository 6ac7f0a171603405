"""`python -m sgdjob_trainer.agent`: torchrun with workers forked from a warm agent keeps torchrun's
contract: a crashed worker fails the round and the restarted (forked again) workers resume from the
checkpoint; a worker stopped by SIGTERM is a failure, not a success; a wrong command is refused;
a node that joins after the job ended, or whose peers never join, exits with its own status, not
torchrun's crash."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.trainer_modes import read_reports
from sgdjob_operator.local.procs import free_port_blocks
from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_CLOSED, EXIT_RENDEZVOUS_TIMEOUT

pytestmark = pytest.mark.multiproc
WORLD = 2


def _launch(
    workdir: Path, training: dict[str, Any], max_restarts: int, rendezvous: list[str] | None = None
) -> subprocess.Popen[bytes]:
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "jobName": "agent",
        "mode": "sync",
        "referenceWorldSize": WORLD,
        "training": {"batchSize": 16, "seed": 1, **training},
    }
    (workdir / "run.json").write_text(json.dumps(config))
    env = {**os.environ, "SGDJOB_REPORT_DIR": str(workdir / "report"), "SGDJOB_METRICS_HOST": "127.0.0.1",
           "SGDJOB_METRICS_PORT": "0", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    where = rendezvous if rendezvous is not None else ["--standalone"]
    cmd = [sys.executable, "-m", "sgdjob_trainer.agent", *where, f"--nproc-per-node={WORLD}",
           f"--max-restarts={max_restarts}", "-m", "sgdjob_trainer", "--config", str(workdir / "run.json")]  # fmt: skip
    return subprocess.Popen(cmd, stdout=(workdir / "log.txt").open("wb"), stderr=subprocess.STDOUT, env=env)


def test_crash_restarts_forked_workers_from_the_checkpoint(tmp_path: Path) -> None:
    ckpt = {"dir": str(tmp_path / "ckpt"), "intervalSteps": 5}
    proc = _launch(
        tmp_path,
        {
            "steps": 30,
            "checkpoint": ckpt,
            "emulation": {"computeSeconds": 0.01},
            "faults": [{"rank": 1, "atStep": 12, "exitCode": 3}],
        },
        max_restarts=1,
    )
    code = proc.wait(timeout=300)
    log = (tmp_path / "log.txt").read_text()
    assert code == 0, log[-4000:]
    assert "EMULATED FAULT: rank 1 exits abruptly" in log
    # torchrun reports the first worker it finds gone: the faulty one (3) or its peer (1)
    assert re.search(r"failed \(exitcode: [13]\) local_rank: \d .* of fn: run_module \(start_method: fork\)", log), log[
        -4000:
    ]
    reports = read_reports(tmp_path / "report", WORLD)
    assert {r["step"] for r in reports} == {30} and reports[0]["restartCount"] == 1
    [resume] = reports[0]["resumes"]
    assert resume["fromStep"] in (5, 10), resume


def test_a_stopped_worker_fails_the_round(tmp_path: Path) -> None:
    ckpt = {"dir": str(tmp_path / "ckpt"), "intervalSteps": 100_000}
    proc = _launch(
        tmp_path, {"steps": 100_000, "checkpoint": ckpt, "emulation": {"computeSeconds": 0.02}}, max_restarts=0
    )
    deadline = time.monotonic() + 240
    while "mode sync at step 0" not in (tmp_path / "log.txt").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    log = (tmp_path / "log.txt").read_text()
    assert code != 0, "a run stopped before its last step is not a success"
    stopped = re.search(r"stopped by SIGTERM at step (\d+) after a final checkpoint", log)
    assert stopped, log[-3000:]
    assert (tmp_path / "ckpt" / f"step-{int(stopped[1]):010d}" / "COMPLETE").exists(), (
        "the forked workers stopped at one step and saved it"
    )


def test_only_modules_are_run() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sgdjob_trainer.agent", "--standalone", "train.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "end the command with `-m MODULE [args]`" in proc.stderr


def test_a_node_joining_after_the_job_ended_exits_with_the_closed_rendezvous_status(tmp_path: Path) -> None:
    [port] = free_port_blocks(1)
    store = subprocess.Popen(
        [sys.executable, "-m", "sgdjob_trainer.rendezvous_store", "--host", "127.0.0.1", "--port", str(port)],
        stdout=(tmp_path / "store.txt").open("wb"),
        stderr=subprocess.STDOUT,
    )
    rdzv = [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-backend=c10d", "--rdzv-id=late", "--nnodes=1:2",
            "--rdzv-conf=is_host=0,join_timeout=60,last_call_timeout=1", "--local-addr=127.0.0.1"]  # fmt: skip
    try:
        first = _launch(tmp_path / "first", {"steps": 5}, max_restarts=0, rendezvous=rdzv)
        assert first.wait(timeout=300) == 0, (tmp_path / "first" / "log.txt").read_text()[-3000:]
        late = _launch(tmp_path / "late", {"steps": 5}, max_restarts=0, rendezvous=rdzv)
        code = late.wait(timeout=120)
    finally:
        store.terminate()
        store.wait(timeout=30)
    log = (tmp_path / "late" / "log.txt").read_text()
    assert code == EXIT_RENDEZVOUS_CLOSED, log[-3000:]
    assert "the job ended before this node joined a world" in log


def test_a_node_whose_peers_never_join_exits_with_the_rendezvous_timeout_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    [port] = free_port_blocks(1)
    store = subprocess.Popen(
        [sys.executable, "-m", "sgdjob_trainer.rendezvous_store", "--host", "127.0.0.1", "--port", str(port)],
        stdout=(tmp_path / "store.txt").open("wb"),
        stderr=subprocess.STDOUT,
    )
    termination = tmp_path / "termination-log"
    monkeypatch.setenv("SGDJOB_TERMINATION_LOG", str(termination))
    rdzv = [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-backend=c10d", "--rdzv-id=alone", "--nnodes=2:2",
            "--rdzv-conf=is_host=0,join_timeout=5,last_call_timeout=1", "--local-addr=127.0.0.1"]  # fmt: skip
    try:
        alone = _launch(tmp_path / "alone", {"steps": 5}, max_restarts=0, rendezvous=rdzv)
        code = alone.wait(timeout=120)
    finally:
        store.terminate()
        store.wait(timeout=30)
    log = (tmp_path / "alone" / "log.txt").read_text()
    assert code == EXIT_RENDEZVOUS_TIMEOUT, log[-3000:]
    said = (
        "the world could not form: fewer than the minimum of 2 nodes joined the rendezvous within its "
        "timeout (5 s); its peers are missing"
    )
    assert f"sgdjob agent: {said}" in log, log[-3000:]
    assert termination.read_text().startswith(said)


def test_a_program_exiting_with_the_rendezvous_timeout_status_fails_the_agent_with_1() -> None:
    cmd = [sys.executable, "-m", "sgdjob_trainer.agent", "--standalone", "--nproc-per-node=1", "--max-restarts=0",
           "--no-python", sys.executable, "-c", f"import sys; sys.exit({EXIT_RENDEZVOUS_TIMEOUT})"]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"the program exited {EXIT_RENDEZVOUS_TIMEOUT}, which the agent reserves; exiting 1" in proc.stderr
