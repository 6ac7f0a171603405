"""The adaptation API end to end: examples/ddp-script-adapt/train.py (the plain DDP script plus the
session's lines) run by `sgdjob run` on 2 real torchrun agents (gloo on loopback) with
training.adaptation: api. A rebalance pushed to rank 0's /control, as the auto policy pushes one,
reaches both ranks at one step (each serves its new batch size, the script's log prints it); an agent
then killed mid-run (a lost node) costs no more than the steps since the script's last checkpoint: the
world re-forms and the script resumes from the checkpoint the session wrote through its save function."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from sgdjob_operator.api.validation import validate_job
from sgdjob_operator.local.progress import ProgressFrame
from sgdjob_operator.local.revive import last_checkpoint
from sgdjob_operator.local.runner import LocalRun
from sgdjob_operator.workers.scrape import ScrapeResult
from sgdjob_trainer.wire.control import ControlCommand
from tests.local.example_runs import REPO, run_polled

pytestmark = pytest.mark.multiproc

EXAMPLE = REPO / "examples" / "ddp-script-adapt"
SPLIT = {0: 44, 1: 20}  # the global batch stays 2 x 32


def _job(folder: Path) -> Any:
    shutil.copy(EXAMPLE / "train.py", folder / "train.py")
    doc = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec = doc["spec"]
    spec["mode"] = "sync"  # the test pushes the rebalance itself; no policy beside it
    spec["minReplicas"] = 2  # the survivor waits for the lost node to come back: one restart, not two
    spec["training"]["command"] = ["python", "train.py", "--epochs", "14", "--step-seconds", "0.03"]
    spec["training"]["checkpoint"]["intervalSteps"] = 10
    return validate_job(doc)


class Scenario:
    """The poll hook: push the split until both ranks serve it, then kill local-1 once a checkpoint
    written after the split exists."""

    def __init__(self) -> None:
        self.applied_at: int | None = None
        self.served: dict[int, int] = {}
        self.killed_after: int | None = None

    async def __call__(self, run: LocalRun, _results: list[ScrapeResult], _snap: ProgressFrame) -> None:
        if self.killed_after is not None:
            return
        statuses = run.last_status
        if self.applied_at is None:
            if 0 in statuses and statuses[0].step >= 5:
                await run.push(ControlCommand(epoch=1, batch_sizes=SPLIT, reason="test: rebalance"))
            if all(r in statuses and statuses[r].control_epoch == 1 for r in SPLIT):
                self.served = {r: statuses[r].batch_size for r in SPLIT}
                self.applied_at = max(statuses[r].step for r in SPLIT)
            return
        newest = last_checkpoint(run.plan.checkpoint_dir) or 0
        agents = [a for a in run.fleet.active() if a.plan.node == "local-1" and a.returncode is None]
        if newest > self.applied_at + 10 and agents:  # the checkpoint holds the split, and a step after it
            agents[0].popen.send_signal(signal.SIGKILL)  # a lost node, as `kill -9` from outside
            self.killed_after = newest


def test_a_pushed_rebalance_reaches_every_rank_and_a_killed_agent_resumes_from_the_scripts_checkpoint(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path)
    scenario = Scenario()
    outcome, logs, context = run_polled(job, tmp_path, scenario, restart_backoff_s=2.0, log_tail=4000)

    # Both ranks applied the split at one step boundary and served it; the script's epochs show it.
    assert scenario.served == SPLIT, context
    applied = re.search(r"control epoch 1 at step (\d+): batch sizes \{0: 44, 1: 20\} \(test: rebalance\)", logs)
    assert applied, context
    batches = [int(b) for b in re.findall(r"epoch \d+: loss [\d.]+ \(world 2, batch (\d+)\)", logs)]
    assert 44 in batches, batches  # rank 0's batch at an epoch's end of the world of 2

    # The kill cost no more than the steps since the newest checkpoint: the next life started from it.
    assert scenario.killed_after is not None, context
    resumed = [int(s) for s in re.findall(r"resumed from the checkpoint of step (\d+)", logs)]
    assert resumed and resumed[0] >= scenario.killed_after, (resumed, scenario.killed_after)
    # Rank 0 lives twice. Its restart count is its agent's: the re-formed round may give rank 0 to the
    # restarted agent of local-1 (count 0) rather than to local-0's (count 1), so only the lives count.
    starts = re.findall(r"rank 0/\d restart (\d+): starting at epoch (\d+), step (\d+)", logs)
    assert len(starts) >= 2 and int(starts[-1][2]) >= scenario.killed_after, starts
    assert "done: 14 epochs" in logs
    deaths = outcome.report["agent_deaths"] if outcome.report else []
    assert [d["node"] for d in deaths] == ["local-1"]
    assert outcome.report is not None and len(outcome.report.get("per_rank", [])) == 2, outcome.report
