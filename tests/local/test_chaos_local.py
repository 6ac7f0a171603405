"""Graceful preemption under `sgdjob run` (issue #18 item 3, the local counterpart of e2e/test_chaos.py
case a): one node's agent gets SIGTERM, as a drained node's kubelet would send. Its worker stops at a
step agreed with its peers, every rank writes a final checkpoint (checkpoint.onStop), and the job goes
on from exactly there: no step is lost. The ungraceful cases (SIGKILL of an agent, a crash loop, a
hang) are tests/local/test_agent_deaths.py and tests/local/test_membership.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.local.test_agent_deaths import once_at, run_job

pytestmark = pytest.mark.multiproc


def test_sigterm_to_an_agent_writes_a_final_checkpoint_and_loses_no_step(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, once_at(45, sig=signal.SIGTERM), steps=250)
    report = outcome.report
    assert outcome.exit_code == 0 and report is not None, outcome.message
    assert report["ok"] and report["steps"] == 250 and report["missing_ranks"] == [], report
    assert report["resumes"], "the stop must have restarted the workers"
    first = report["resumes"][0]
    # A final checkpoint at the agreed stop step: not one of the 20-step interval's, and nothing lost.
    assert first["lostSteps"] == 0 and first["fromStep"] == first["reachedStep"] >= 45, report["resumes"]
    assert report["lost_steps"] == 0, report
    print(
        f"local graceful stop: resumed at step {first['fromStep']} (reached {first['reachedStep']}), "
        f"{first['restartSeconds']:.1f}s from the last progress to the loaded model"
    )
