"""The rendezvous store process or rank 0's agent killed with SIGKILL mid-run: neither fails the job.
A dead store is an infrastructure fault: the runner starts it again on the same port, the agents
that lost it are restarted without charge to runPolicy.backoffLimit, and training goes on from the
last checkpoint. Real store, torchrun agents and trainers (emulated compute) on loopback."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from sgdjob_operator.local.progress import ProgressFrame
from sgdjob_operator.local.runner import LocalRun
from tests.local.test_agent_deaths import Killer, once_at, run_job

pytestmark = pytest.mark.multiproc


def store_at(step: int) -> Killer:
    done: list[bool] = []

    def killer(run: LocalRun, snap: ProgressFrame) -> bool:
        if done or snap.step < step:
            return False
        [store] = [s for s in run.fleet.procs.services if s.returncode is None]
        os.kill(store.popen.pid, signal.SIGKILL)
        done.append(True)
        return True

    return killer


def test_a_killed_store_is_restarted_and_a_job_with_backoff_limit_0_succeeds(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, store_at(40), steps=300, backoff_limit=0)
    report = outcome.report
    assert outcome.exit_code == 0 and report is not None, outcome.message
    assert report["ok"] and report["steps"] == 300, report
    [death] = report["store_deaths"]
    assert death["exit"] == "killed by SIGKILL" and death["restarted_s"] >= death["time_s"], death
    assert death["step"] >= 40 and 0 <= death["lost_steps"] <= 20, death  # one checkpoint interval
    assert death["recovery_s"] is not None and 0 < death["recovery_s"] < 120, death
    # Agents that died of the lost store are restarted without charge to backoffLimit 0.
    assert all(d["infrastructure"] for d in report.get("agent_deaths", [])), report.get("agent_deaths")


def test_a_killed_rank_0_agent_is_restarted_and_the_job_succeeds(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, once_at(40, node="local-0"), steps=400)
    report = outcome.report
    assert outcome.exit_code == 0 and report is not None, outcome.message
    assert report["ok"] and report["steps"] == 400 and report["missing_ranks"] == [], report
    [death] = report["agent_deaths"]
    assert death["node"] == "local-0" and death["action"] == "restart" and death["recovery_s"] is not None, death
    assert death["lost_steps"] <= 20, death
