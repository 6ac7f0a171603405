"""A script on the adaptation API follows `mode: async` and back to sync, on 4 real torchrun ranks (gloo,
loopback), rank 3 an EMULATED straggler (it sleeps 16x longer a step). The commands go to rank 0's
/control, as a controller sends them (hierarchy_script.py is the script).

Checked from the JSON line each rank writes a step: in async the fast ranks did not wait for the
straggler (many more steps than it, each a fast step's time); the ranks drew their batches from one
queue (no sample twice in an epoch, and the fast ranks took most of them); every meeting (a checkpoint,
an epoch's end) and the switch back left every rank with the server's model, the checkpoint holding it;
back in sync every rank holds the same parameters and momentum at every step; /status says the mode."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import pytest
import torch

from sgdjob_trainer.config import Adaptation, Checkpoint, SyncMode, TrainingConfig
from tests.trainer.test_adapt_hierarchy import (
    _all_in,
    _get,
    _lines,
    _plain_params,
    _post,
    _until,
    script_env,
    there_and_back,
)

pytestmark = pytest.mark.multiproc

SLOW, FAST, CHECKPOINT_EVERY, SAMPLES = 0.08, 0.005, 25, 1024
SCRIPT = Path(__file__).with_name("hierarchy_script.py")


def _launch(
    tmp_path: Path, *extra: str, restarts: int = 0, mode: SyncMode = SyncMode.SYNC
) -> tuple[subprocess.Popen[str], int]:
    """The script on 4 ranks under SGDJob's torchrun agent, rank 3 the straggler, the job starting in
    `mode`; its ranks serve base + local rank."""
    training = TrainingConfig(
        command=["python", SCRIPT.name],
        adaptation=Adaptation.API,
        batch_size=8,
        checkpoint=Checkpoint(dir=str(tmp_path / "ckpt"), interval_steps=CHECKPOINT_EVERY, keep=100),
    )
    base, env = script_env(tmp_path, training, mode)
    env |= {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a restarted world's ranks connect afresh (recovery.py)
    args = ["--out", str(tmp_path), "--samples", str(SAMPLES), "--step-seconds", str(FAST)]
    args += ["--slow-rank", "3", "--slow-seconds", str(SLOW), "--left", "async", *extra]
    command = [sys.executable, "-m", "sgdjob_trainer.agent", "--standalone", "--nproc-per-node=4"]
    command += [f"--max-restarts={restarts}", "--no-python", sys.executable, str(SCRIPT)]
    log = (tmp_path / "out.log").open("w")
    proc = subprocess.Popen([*command, *args], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, base


def _end(proc: subprocess.Popen[str], tmp_path: Path, deadline: float) -> str:
    """The run's output once it exits (killed with every worker at the deadline)."""
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            subprocess.run(["pkill", "-KILL", "-f", str(tmp_path)], check=False)
            proc.wait()
    return (tmp_path / "out.log").read_text()


def test_a_script_runs_async_from_one_queue_and_comes_back_to_one_model(tmp_path: Path) -> None:
    # 8 steps after the switch back: rank 0 may log no line at the switch's step (below), and 6 are checked.
    proc, base = _launch(tmp_path, "--after-sync", "8")
    try:
        deadline = time.monotonic() + 90
        statuses = there_and_back(proc, base, deadline, "async", 200)
    finally:
        output = _end(proc, tmp_path, deadline)
    assert proc.returncode == 0, output[-4000:]
    assert all(s["asyncCapable"] and s["controlEpoch"] == 1 for s in statuses), statuses
    assert "async at step" in output and "sync at step" in output, output[-4000:]
    ranks = [_lines(tmp_path, r) for r in range(4)]
    in_async = [[line for line in lines if line["mode"] == "async"] for lines in ranks]

    # (a) The fast ranks never waited for the straggler: each took several times its steps, at a fast pace.
    # Waiting would make the counts equal; the sleeps alone make them 16x apart, but on a loaded 2-core
    # machine a fast rank's compute and pushes take most of its step (ci70: 117-168 against 56).
    counts = [len(lines) for lines in in_async]
    assert min(counts[:3]) >= 2 * counts[3], counts
    gaps = [b["t"] - a["t"] for a, b in zip(in_async[0], in_async[0][1:], strict=False)]
    assert median(gaps) < SLOW / 2, gaps

    # (b) One queue: no sample twice in an epoch, every sample of a whole async epoch read once, most of
    # them by the fast ranks; every rank left an epoch before any began the next (they meet at its end).
    epochs: dict[int, list[int]] = {}
    for lines in in_async:
        for line in lines:
            epochs.setdefault(line["epoch"], []).extend(line["indices"])
    assert all(len(v) == len(set(v)) for v in epochs.values()), "a sample read twice in one epoch"
    whole = [e for e in epochs if min(epochs) < e < max(epochs)]
    assert whole and all(sorted(epochs[e]) == list(range(SAMPLES)) for e in whole)
    assert sum(len(line["indices"]) for line in in_async[3]) < 0.15 * sum(map(len, epochs.values()))
    for e in sorted({line["epoch"] for lines in ranks for line in lines})[:-1]:
        ended = max(line["t"] for lines in ranks for line in lines if line["epoch"] == e)
        assert ended < min(line["t"] for lines in ranks for line in lines if line["epoch"] == e + 1), e

    # (c) A checkpoint in async is a meeting: every rank logged its step with the server's model, saved.
    by_step = [{line["step"]: line for line in lines} for lines in ranks]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    met = [k for k in saved if all(by_step[r].get(k, {}).get("mode") == "async" for r in range(4))]
    assert len(met) >= 3, (saved, counts)
    for k in met:
        model = _plain_params(torch.load(tmp_path / "ckpt" / f"step-{k:010d}" / "checkpoint.pt", weights_only=False))
        assert all(by_step[r][k]["params"] == model for r in range(4)), k

    # (d) Back in sync every rank holds the same parameters and momentum at every step, and at the end.
    back = min(line["step"] for line in ranks[0] if line["mode"] == "sync" and line["step"] > in_async[0][0]["step"])
    # From the step after the switch's: a rank that met the others at its epoch's end (between two steps)
    # logged no line at the switch's step (ci66: rank 0 logged step 242 in sync, another rank no 242).
    after = [k for k in by_step[0] if k > back]
    assert len(after) >= 6 and all(by_step[r][k]["mode"] == "sync" for k in after for r in range(4))
    assert all(by_step[r][k]["params"] == by_step[0][k]["params"] for k in after for r in (1, 2, 3))
    assert all(by_step[r][k]["momentum"] == by_step[0][k]["momentum"] for k in after for r in (1, 2, 3))
    finals = [json.loads((tmp_path / f"final{r}.json").read_text()) for r in range(4)]
    assert all(f == finals[0] for f in finals)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_async_resumes_after_rank_0_dies_and_the_first_rank_done_ends_every_ranks_training(
    tmp_path: Path, how: signal.Signals
) -> None:
    """Rank 0 holds shard 0 and the data queue. Killed in async, the world restarts from the newest
    checkpoint in async; stopped (SIGTERM, as a pod's deletion), every rank stops at one agreed step
    after a checkpoint of it, and the next life goes on from that step. The fast ranks reach
    --max-steps first; the first to finish ends the others' loops (the straggler's loader hands out
    no more), and every rank finishes with one model."""
    proc, base = _launch(tmp_path, "--max-steps", "200", restarts=1)
    try:
        deadline = time.monotonic() + 120
        _until(proc, deadline, lambda: (s := _get(base)) is not None and s["step"] >= 6)
        _post(base, {"epoch": 1, "mode": "async", "reason": "test: async"})
        _until(proc, deadline, lambda: _all_in(base, "async"))
        _until(proc, deadline, lambda: len(list((tmp_path / "ckpt").glob("step-*"))) >= 2)
        killed = int((tmp_path / "pid0").read_text())
        os.kill(killed, how)
        _until(proc, deadline, lambda: (tmp_path / "pid0").read_text() != str(killed) and _all_in(base, "async"))
    finally:
        output = _end(proc, tmp_path, deadline)
    assert proc.returncode == 0, output[-4000:]
    assert "resumed from the checkpoint of step" in output and "async at step" in output, output[-4000:]
    assert "resumed in async" in output, output[-4000:]
    if how == signal.SIGTERM:
        stopped = re.findall(r"stopped at the agreed step (\d+) after a checkpoint", output)
        assert len(stopped) == 4 and len(set(stopped)) == 1, stopped
        assert f"resumed from the checkpoint of step {stopped[0]} " in output, "no step lost"
    ranks = [_lines(tmp_path, r) for r in range(4)]  # the second life's (each life writes its files anew)
    [resumed] = [int(n) for n in re.findall(r"resumed from the checkpoint of step (\d+)", output)]
    assert all(lines[0]["mode"] == "async" for lines in ranks), "the new life trains in async from its first step"
    # Each rank's first step follows the checkpoint's (the straggler's may end at a meeting, a later step).
    assert min(lines[0]["step"] for lines in ranks) == resumed + 1
    assert all(lines[0]["step"] > resumed for lines in ranks)
    # A fast rank reached --max-steps and finished; the straggler, far fewer steps in, ended with it (at
    # its next step or its epoch's end, between two steps: no line there), the world at the most steps.
    assert max(lines[-1]["step"] for lines in ranks) == 200
    assert 3 * len(ranks[3]) < min(len(lines) for lines in ranks[:3])
    finals = [json.loads((tmp_path / f"final{r}.json").read_text()) for r in range(4)]
    assert all(f == finals[0] for f in finals)
    newest = max((tmp_path / "ckpt").glob("step-*"))
    assert newest.name == f"step-{200:010d}", "finish() wrote the world's model at the most steps"
    assert _plain_params(torch.load(newest / "checkpoint.pt", weights_only=False)) == finals[0], newest


def test_a_job_whose_mode_is_async_trains_its_script_async_from_the_first_step(tmp_path: Path) -> None:
    """`spec.mode: async` on the adaptation API: no command, the session enters async once the model
    and the loader are there; the fast ranks run ahead from step 1 and the world ends with one model."""
    proc, _ = _launch(tmp_path, "--max-steps", "60", mode=SyncMode.ASYNC)
    output = _end(proc, tmp_path, time.monotonic() + 60)
    assert proc.returncode == 0, output[-4000:]
    assert "the job's mode is async" in output, output[-4000:]
    ranks = [_lines(tmp_path, r) for r in range(4)]
    # Every step async (a rank's last line may come after the finish, back in sync with one model).
    assert all(line["mode"] == "async" for lines in ranks for line in lines[:-1])
    assert [lines[0]["step"] for lines in ranks] == [1, 1, 1, 1]
    assert max(lines[-1]["step"] for lines in ranks) == 60 and 3 * len(ranks[3]) < min(map(len, ranks[:3]))
    finals = [json.loads((tmp_path / f"final{r}.json").read_text()) for r in range(4)]
    assert all(f == finals[0] for f in finals)
