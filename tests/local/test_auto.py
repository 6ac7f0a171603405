"""`sgdjob run` in auto mode: the policy core drives real trainer processes on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sgdjob_operator.local.auto import active_mode, applied_epoch, command_for
from sgdjob_operator.local.progress import Snapshot, WorkerView
from sgdjob_operator.policy import Rebalance, SwitchMode
from sgdjob_operator.scrape import Endpoint, ScrapeResult

REPO = Path(__file__).resolve().parents[2]
SGDJOB = str(Path(sys.executable).parent / "sgdjob")


def _worker(rank: int, mode: str, *, fresh: bool = True, done: bool = False) -> WorkerView:
    return WorkerView(rank=rank, node=None, step=1, samples=1, compute_s=1.0, wait_s=0.0, loss=None, mode=mode, done=done, fresh=fresh)


def test_commands_carry_the_decision() -> None:
    switch = command_for(SwitchMode("hierarchical", "clusters", groups=((0, 1), (2, 3))), 3, {})
    assert (switch.epoch, switch.mode, switch.groups, switch.reason) == (3, "hierarchical", [[0, 1], [2, 3]], "clusters")
    rebalance = command_for(Rebalance({3: 8}, "slow rank"), 4, {0: 40, 3: 16})
    assert rebalance.mode is None and rebalance.batch_sizes == {0: 40, 3: 8}


def test_applied_epoch_and_active_mode_read_the_workers() -> None:
    ep = Endpoint("http://127.0.0.1:1")
    assert applied_epoch([ScrapeResult(ep, 0.0, None, {"rank": 1, "controlEpoch": 5}, None)]) is None
    assert applied_epoch([ScrapeResult(ep, 0.0, None, {"rank": 0, "controlEpoch": 2}, None)]) == 2
    snap = Snapshot(time=1.0, elapsed_s=1.0, workers=(_worker(0, "async"), _worker(1, "async"), _worker(2, "sync", fresh=False)))
    assert active_mode(snap, "sync") == "async"
    mixed = Snapshot(time=1.0, elapsed_s=1.0, workers=(_worker(0, "async"), _worker(1, "sync")))
    assert active_mode(mixed, "sync") == "sync"  # mid-switch: keep what we had


@pytest.mark.multiproc
def test_quickstart_switches_mode_with_a_reason_and_writes_plots(tmp_path: Path) -> None:
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["training"]["steps"] = 300  # enough for the policy to act; keeps the tier short
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    proc = subprocess.run([SGDJOB, "run", str(path), "--out", str(out), "--timeout", "400"], capture_output=True, text=True, timeout=460, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["mode"] == "auto" and report["missing_ranks"] == []
    switches = [d for d in report["decisions"] if d["action"] == "switchMode"]
    assert switches and switches[0]["reason"] and "rank 3" in switches[0]["reason"], report["decisions"]
    assert f"switch to {switches[0]['mode']}" in output
    assert [e["mode"] for e in report["mode_timeline"]][:2] == ["sync", switches[0]["mode"]]
    assert report["final_loss"] < report["initial_loss"]
    for name in ("step_times.png", "loss.png", "throughput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"quickstart (300 steps) auto: efficiency {report['efficiency']:.2f}, switches {len(switches)}")
