"""`sgdjob run` of a job that brings its own training code: a task module beside the job file (no
PYTHONPATH set by the user), AdamW built by the task, in async and in auto. Every fixed mode with
AdamW runs in tests/trainer/test_optimizer_modes.py (its state through every switch) and on the
cluster in e2e/test_scenarios_own_code.py (one job walked through every mode); the same code
path in each mode is not run a third time here, to keep CI's time for what only this tier shows."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.local.example_runs import REPO, SGDJOB

# The charlm example after 150 steps on 2 workers (a uniform guess is 7 bits per character).
BITS_AFTER_150 = 4.5

TASK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    from sgdjob_trainer.data import digits_dataset
    from sgdjob_trainer.task import Task


    def adamw(model):
        decay = [p for p in model.parameters() if p.dim() >= 2]
        plain = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": plain, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.004, betas=(0.9, 0.98))


    def build():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        return Task(model=model, train_data=digits_dataset(), loss=F.cross_entropy, optimizer=adamw)
    """
)


def _job(folder: Path, mode: str) -> Path:
    (folder / "my_digits_task.py").write_text(TASK)
    emulation = {"computeSeconds": 0.02, "slowdowns": [{"rank": 2, "factor": 3.0}]}
    spec = {
        "replicas": 3,
        "minReplicas": 3,
        "mode": mode,
        "policy": {"intervalSeconds": 1, "persistenceIntervals": 2},
        "training": {
            "task": "my_digits_task:build",
            "steps": 3000,
            "batchSize": 16,
            "evaluation": {"everySteps": 10, "samples": 200},
            "target": {"metric": "accuracy", "value": 0.93},
            "emulation": emulation,
        },
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob",
                                    "metadata": {"name": "own-code"}, "spec": spec}))  # fmt: skip
    return path


@pytest.mark.parametrize("mode", ["async", "auto"])
def test_a_task_with_its_own_adamw_trains_to_its_target(tmp_path: Path, mode: str) -> None:
    (tmp_path / "code").mkdir()
    job = _job(tmp_path / "code", mode)
    out = tmp_path / "out"
    # cwd elsewhere: the module is found because it sits beside the job file.
    proc = subprocess.run([SGDJOB, "run", str(job), "--out", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["reason"] == "TargetReached", report
    # The target was reached by a validation at target_step; the final one comes a few steps later.
    reached = next(p for p in report["validation_curve"] if p["step"] == report["target_step"])
    assert report["steps"] < 3000 and reached["accuracy"] >= 0.93 and report["validation"]["accuracy"] >= 0.88
    logs = "\n".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "task my_digits_task:build, AdamW" in logs, "the task's own optimizer ran"
    if mode != "auto":
        assert [m["mode"] for m in report["mode_timeline"]] == [mode]
    else:
        # The policy acted on the 3x straggler: a switch or a rebalance, each with its reason.
        assert report["decisions"], report["mode_timeline"]


def test_a_task_that_cannot_be_imported_fails_the_run_naming_the_field(tmp_path: Path) -> None:
    job = _job(tmp_path, "sync")
    data = yaml.safe_load(job.read_text())
    data["spec"]["training"]["task"] = "no_such_module:build"
    data["spec"]["runPolicy"] = {"backoffLimit": 0}  # the same error on every restart
    job.write_text(yaml.safe_dump(data))
    proc = subprocess.run([SGDJOB, "run", str(job), "--out", str(tmp_path / "out"), "--timeout", "120"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "training.task: cannot import 'no_such_module:build'" in output, output[-4000:]


@pytest.mark.parametrize("mode", ["async"])
def test_the_transformer_example_learns_with_stale_gradients(tmp_path: Path, mode: str) -> None:
    """examples/custom-task as it ships (its module found beside its job file), shortened: 2 workers,
    150 steps, async (the mode whose stale updates could keep it from learning); the full 600 steps
    are tests/trainer/test_charlm_task.py's, every mode on the cluster e2e/test_scenarios_own_code.py's."""
    example = REPO / "examples" / "custom-task"
    job = yaml.safe_load((example / "job.yaml").read_text())
    spec = job["spec"]
    spec.update(replicas=2, minReplicas=2, maxReplicas=2)
    training = spec["training"]
    training.update(steps=150, checkpoint={"dir": str(tmp_path / "ckpt"), "intervalSteps": 100})
    training["lrPolicy"]["warmupSteps"] = 20
    training["evaluation"]["everySteps"] = 50
    training["emulation"] = {"computeSeconds": 0.01, "slowdowns": [{"rank": 1, "factor": 2.0}]}
    # The user's folder: their package and their job file side by side.
    shutil.copytree(example / "charlm", tmp_path / "code" / "charlm")
    path = tmp_path / "code" / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    proc = subprocess.run([SGDJOB, "run", str(path), "--mode", mode, "--out", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((out / "report.json").read_text())
    curve = report["validation_curve"]
    assert [m["mode"] for m in report["mode_timeline"]] == [mode] and report["steps"] == 150
    print(f"{mode}: bits/char {curve[0]['metric']:.2f} -> {curve[-1]['metric']:.2f}, tokens/s "
          f"{report['throughput_samples_per_s'] * 64:.0f}")  # fmt: skip
    assert curve[0]["metric"] > 6.5 and curve[-1]["metric"] < BITS_AFTER_150, curve
