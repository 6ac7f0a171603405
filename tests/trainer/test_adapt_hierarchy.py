"""A script on the adaptation API follows `mode: hierarchical` and back to sync, on 4 real torchrun
ranks (gloo, loopback) that claim two nodes of two ranks each, rank 3 an EMULATED straggler (it
sleeps 16x longer a step). The commands go to rank 0's /control, as a controller sends them. The same
run three times: a plain DDP script that hands `adapt.start` its optimizer (hierarchy_script.py), a
Lightning module under SGDJobTrainer, whose callback hands the session Lightning's optimizer
(lightning_hierarchy_script.py; skipped only without the `lightning` extra), and a Hugging Face Trainer
under SGDJobTrainer whose loss Trainer divides by its item count over the world, in hierarchical the
group's (hf_hierarchy_script.py; skipped only without the `hf` extra).

Checked from the JSON line each rank writes a step (hierarchy_script.py): inside a node's group the
ranks hold the same parameters at every step while the groups drift apart between the averaging
rounds; a checkpoint taken in hierarchical, the switch back and every sync step after it leave every
rank with the same parameters and momentum; the fast group ran ahead of the straggler by more than a
step (no world agreement a step) and by no more than the staleness bound; /status says the mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import pytest
import torch

from sgdjob_operator.local.procs import free_port_blocks
from sgdjob_trainer.config import Adaptation, Checkpoint, HierarchicalConfig, SyncMode, TrainingConfig
from sgdjob_trainer.wire.launch_contract import RunConfig
from tests.trainer.two_ranks import REPO

pytestmark = pytest.mark.multiproc

EVERY, STALENESS, CHECKPOINT_EVERY = 3, 1, 10
FAST = 0.005
TOKEN = "hierarchy-test-token"


def _plain_params(saved: dict[str, Any]) -> list[float]:
    model = saved["model"]
    return torch.cat([model["weight"].flatten(), model["bias"].flatten()]).tolist()


def _hf_params(saved: dict[str, Any]) -> list[float]:
    model = saved["model"]
    return torch.cat([model["net.weight"].flatten(), model["net.bias"].flatten()]).tolist()


def _lightning_params(saved: dict[str, Any]) -> list[float]:
    model = saved["state_dict"]
    return torch.cat([model["net.weight"].flatten(), model["net.bias"].flatten()]).tolist()


@dataclass(frozen=True)
class Script:
    path: Path
    slow: float  # the straggler's seconds a step
    within_s: float  # the run's deadline (Lightning's imports on 4 ranks take a while on 2 cores)
    saved_params: Callable[[dict[str, Any]], list[float]]  # the parameters in its checkpoint file
    needs: str | None = None  # a module without which it skips


SCRIPTS = {
    "ddp-script": Script(Path(__file__).with_name("hierarchy_script.py"), 0.08, 50, _plain_params),
    "lightning": Script(
        Path(__file__).with_name("lightning_hierarchy_script.py"), 0.15, 150, _lightning_params, "lightning"
    ),
    "hf": Script(Path(__file__).with_name("hf_hierarchy_script.py"), 0.15, 150, _hf_params, "transformers"),
}


def _get(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc
    except OSError:
        return None


def _post(port: int, command: dict[str, Any]) -> None:
    body = json.dumps(command).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/control", body, headers, method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 202


def _until(proc: subprocess.Popen[str], deadline: float, ready: Any) -> Any:
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        assert proc.poll() is None, "the world ended before the test sent its commands"
        time.sleep(0.05)
    raise AssertionError("timed out")


def _all_in(base: int, mode: str) -> list[dict[str, Any]] | None:
    """Every rank's /status, once every rank serves `mode`."""
    statuses = [_get(base + r) for r in range(4)]
    ready = [s for s in statuses if s is not None and s["mode"] == mode]
    return ready if len(ready) == len(statuses) else None


def _lines(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


def _lead(fast: list[dict[str, Any]], slow: list[dict[str, Any]], steps: range) -> list[int]:
    """For each of the fast rank's `steps`: how many steps it was ahead of the slow rank's finished ones."""
    times = [r["t"] for r in slow]
    return [r["step"] - sum(t <= r["t"] for t in times) for r in fast if r["step"] in steps]


def script_env(tmp_path: Path, training: TrainingConfig, mode: SyncMode = SyncMode.SYNC) -> tuple[int, dict[str, str]]:
    """The environment of 4 ranks that SGDJob runs `training` for (starting in `mode`), and the port
    rank 0 serves: each rank serves base + its local rank, four free ports below the ephemeral range."""
    config = tmp_path / "run-config.json"
    doc = RunConfig(job_name="script-test", mode=mode, training=training)
    config.write_text(doc.model_dump_json(by_alias=True))
    [base] = free_port_blocks(1, size=4)
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "SGDJOB_RUN_CONFIG": str(config), "SGDJOB_METRICS_PORT": str(base)}
    env |= {"SGDJOB_CONTROL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return base, env


def there_and_back(
    proc: subprocess.Popen[str], base: int, deadline: float, mode: str, steps: int
) -> list[dict[str, Any]]:
    """After 6 steps, `mode` by a command (epoch 1) to rank 0's /control, as a controller sends it, and
    once the straggler (rank 3) is `steps` steps further, back to sync (epoch 2); every rank's /status
    once all were in `mode`."""
    _until(proc, deadline, lambda: (s := _get(base)) is not None and s["step"] >= 6)
    _post(base, {"epoch": 1, "mode": mode, "reason": f"test: {mode}"})
    statuses: list[dict[str, Any]] = _until(proc, deadline, lambda: _all_in(base, mode))
    entered = max(s["step"] for s in statuses)
    _until(proc, deadline, lambda: (s := _get(base + 3)) is not None and s["step"] >= entered + steps)
    _post(base, {"epoch": 2, "mode": "sync", "reason": "test: back"})
    return statuses


@pytest.mark.parametrize("which", sorted(SCRIPTS))
def test_a_script_runs_hierarchical_in_node_groups_and_comes_back_to_one_model(tmp_path: Path, which: str) -> None:
    script = SCRIPTS[which]
    if script.needs is not None:
        pytest.importorskip(script.needs, reason=f"the {script.needs} extra is not installed")
    training = TrainingConfig(
        command=["python", script.path.name],
        adaptation=Adaptation.API,
        batch_size=8,
        hierarchical=HierarchicalConfig(average_every=EVERY, staleness=STALENESS),
        checkpoint=Checkpoint(dir=str(tmp_path / "ckpt"), interval_steps=CHECKPOINT_EVERY, keep=100),
    )
    base, env = script_env(tmp_path, training)
    args = ["--out", str(tmp_path), "--slow-rank", "3", "--slow-seconds", str(script.slow), "--step-seconds", str(FAST)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script.path)]
    proc = subprocess.Popen(
        [*command, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + script.within_s
        statuses = there_and_back(proc, base, deadline, "hierarchical", 24)
        output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    assert all(s["hierarchicalCapable"] and s["controlEpoch"] == 1 for s in statuses), statuses
    assert "hierarchical at step" in output and "groups [[0, 1], [2, 3]]" in output, output[-4000:]

    ranks = [_lines(tmp_path, r) for r in range(4)]
    modes = [[line["mode"] for line in lines] for lines in ranks]
    assert all(m == modes[0] for m in modes), "every rank switches at the same step, both ways"
    hier = [line["step"] for line in ranks[0] if line["mode"] == "hierarchical"]
    first, back = hier[0], hier[-1] + 1  # the step of each switch's boundary (its line: the new mode)
    assert hier == list(range(first, back)) and modes[0][back - 1] == "sync"
    by_step = [{line["step"]: line for line in lines} for lines in ranks]

    def same(step: int, a: int, b: int, key: str = "params") -> bool:
        return bool(by_step[a][step][key] == by_step[b][step][key])

    # (a) Each node's group steps one model; the groups differ between rounds.
    inside = range(first + 1, back)
    assert all(same(k, 0, 1) and same(k, 2, 3) for k in inside)
    assert sum(not same(k, 0, 2) for k in inside) > len(inside) // 2

    # (b) A checkpoint in hierarchical holds the merged model every rank continues from; back in sync
    # every rank holds the same parameters and momentum at every step, and at the end.
    merged = [k for k in inside if k % CHECKPOINT_EVERY == 0]
    assert merged and all(same(k, 0, r) and same(k, 0, r, "momentum") for k in merged for r in (1, 2, 3))
    saved = torch.load(tmp_path / "ckpt" / f"step-{merged[0]:010d}" / "checkpoint.pt", weights_only=False)
    assert script.saved_params(saved) == by_step[0][merged[0]]["params"]
    after = [k for k in by_step[0] if k >= back]
    assert len(after) >= 6 and all(same(k, 0, r) and same(k, 0, r, "momentum") for k in after for r in (1, 2, 3))
    finals = [json.loads((tmp_path / f"final{r}.json").read_text()) for r in range(4)]
    assert all(f == finals[0] for f in finals)

    # (c) The fast group did not wait for the straggler a step: it ran rounds ahead, within the bound,
    # and most of its steps took a fast step's time, where in sync every step took the straggler's.
    leads = _lead(ranks[0], ranks[3], inside)
    assert EVERY <= max(leads) <= (STALENESS + 1) * EVERY + 1, leads
    assert max(_lead(ranks[0], ranks[3], range(1, first))) <= 1
    gaps = {k: by_step[0][k]["t"] - by_step[0][k - 1]["t"] for k in range(2, len(by_step[0]))}
    assert median(gaps[k] for k in inside if k > first + 1) < script.slow / 2, gaps
    assert median(gaps[k] for k in range(2, first)) > script.slow * 0.9, gaps
