"""The framework integrations end to end: examples/hf-trainer/train.py (a tiny GPT-2 built from a
config, on sgdjob_trainer.integrations.hf's SGDJobTrainer) and examples/lightning/train.py (a tiny
character-level model built from code, on sgdjob_trainer.integrations.lightning's SGDJobTrainer), each
run by `sgdjob run` on 2 real torchrun agents (gloo on loopback) with training.adaptation: api. A
rebalance pushed to rank 0's /control, as the auto policy pushes one, reaches both ranks at one step
(each serves its new batch size and trains on it, the script's lines print it); a SIGTERM to rank 1's
worker then makes the world stop at one agreed step with a checkpoint, and the restarted world resumes
the framework's trainer from exactly that step, the split kept, and finishes the script's steps.
Each is skipped only without its extra (CI installs both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.local.example_runs import REPO, RebalanceThenStop, example_job, run_polled

pytestmark = pytest.mark.multiproc

STEPS = 90
# example folder -> (its extra, the extra's modules, what the framework's trainer logs at a resume before the step)
EXAMPLES = {
    "hf-trainer": ("hf", ("transformers", "accelerate"), "Trainer resumed at global step"),
    "lightning": ("lightning", ("lightning",), "Lightning resumed at global step"),
}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_a_rebalance_reaches_both_ranks_and_an_agreed_stop_resumes_the_trainer_at_its_step(
    example: str, tmp_path: Path
) -> None:
    extra, modules, resumed = EXAMPLES[example]
    for module in modules:
        pytest.importorskip(module, reason=f"the {extra} extra is not installed: pip install -e .[{extra}]")
    job = example_job(REPO / "examples" / example, tmp_path, STEPS)
    scenario = RebalanceThenStop(str(tmp_path / "out"), {0: 24, 1: 8})  # the global batch stays 2 x 16
    outcome, logs, context = run_polled(job, tmp_path, scenario, restart_backoff_s=1.0, log_tail=5000)
    scenario.check(logs, context, STEPS, resumed=resumed)
    # Lightning's warning when a resumed loader is not its own resumable kind: the session's loader is.
    assert "dataloader is not resumable" not in logs, context
    assert outcome.report is not None and len(outcome.report.get("per_rank", [])) == 2, outcome.report
