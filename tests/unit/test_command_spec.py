"""Command mode (spec.training.command) as pure parts: validation, the agents' argv, the local
check before any agent starts, and the worker pod on Kubernetes."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from sgdjob_operator.api.models import JobMode, Phase, SGDJob, SGDJobStatus
from sgdjob_operator.api.validation import MODE_NOT_ADJUSTABLE, SpecError, spec_warnings, validate_spec
from sgdjob_operator.cli import main
from sgdjob_operator.k8s.builders import JobRef, build_worker_pod
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.local.command_mode import command_check, local_command
from sgdjob_operator.local.launch import plan_launch
from sgdjob_trainer.config import SyncMode
from tests.unit.test_status import T0, pod, rdzv

COMMAND = ["python", "train.py", "--epochs", "3"]


def _problems(training: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as err:
        validate_spec({"replicas": 2, "training": training})
    return "\n".join(err.value.problems)


def test_command_and_task_are_mutually_exclusive_naming_the_field() -> None:
    text = _problems({"command": COMMAND, "task": "mod:build"})
    assert "training.command" in text and "mutually exclusive" in text


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"emulation": {"computeSeconds": 0.1}}, "emulation"),
        ({"target": {"metric": "loss", "value": 0.1}, "evaluation": {"everySteps": 5}}, "target"),
        ({"faults": [{"kind": "crash", "rank": 0, "atStep": 3}]}, "faults"),
    ],
)
def test_what_needs_the_trainer_is_refused_with_a_command(extra: dict[str, Any], field: str) -> None:
    text = _problems({"command": COMMAND, **extra})
    assert f"training.{field}" in text and "training.command" in text


def test_an_empty_command_is_refused() -> None:
    assert "command" in _problems({"command": []})


def _job(command: list[str]) -> SGDJob:
    return SGDJob.model_validate(
        {
            "apiVersion": "sgdjob.dev/v1alpha1",
            "kind": "SGDJob",
            "metadata": {"name": "byoc"},
            "spec": {"replicas": 2, "minReplicas": 1, "training": {"command": command}},
        }
    )


def test_agents_exec_the_users_command_with_the_runners_python_in_the_work_dir(tmp_path: Path) -> None:
    ports: dict[str, Any] = {"rdzv_port": 29000, "metrics_bases": [30000, 30010], "token": "t"}
    out = tmp_path / "out"
    plan = plan_launch(
        _job(COMMAND), SyncMode.SYNC, out, python="/venv/bin/python", base_env={}, work_dir=tmp_path, **ports
    )
    for agent in plan.agents:
        tail = agent.argv[agent.argv.index("--no-python") :]
        assert tail == ("--no-python", "/venv/bin/python", "train.py", "--epochs", "3")
        assert "--nnodes=1:2" in agent.argv and "-m" in agent.argv[:3]  # our agent, elastic 1..2
        assert agent.cwd == tmp_path
    assert local_command(["./run.sh", "x"], "/p") == ("./run.sh", "x")


def test_the_local_check_names_the_field_and_the_fix(tmp_path: Path) -> None:
    missing = command_check(["no-such-program-xyz", "a"], tmp_path, "/p", "/usr/bin:/bin")
    assert missing is not None and "spec.training.command[0]" in missing and "not found on PATH" in missing
    no_script = command_check(COMMAND, tmp_path, "/usr/bin/python3", "/usr/bin")
    assert no_script is not None and "spec.training.command[1]" in no_script and "train.py" in no_script
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\n")
    assert "not an executable" in (command_check(["./run.sh"], tmp_path, "/p", "") or "")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert command_check(["./run.sh"], tmp_path, "/p", "") is None
    (tmp_path / "train.py").write_text("")
    assert command_check(COMMAND, tmp_path, sys.executable, "") is None


def _pod(command: list[str], template: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = validate_spec(
        {"replicas": 2, "training": {"command": command}, **({"template": template} if template else {})}
    )
    return build_worker_pod(JobRef(name="j", namespace="ns", uid="u"), spec, 0, default_image="img")


def test_the_worker_pod_runs_an_agent_no_python_on_the_command() -> None:
    main = _pod(COMMAND)["spec"]["containers"][0]
    assert main["command"][:2] == ["sh", "-c"] and "exec torchrun --no-python" in main["command"][2]
    assert "exec python3 -m sgdjob_trainer.agent --no-python" in main["command"][2]
    assert main["args"] == COMMAND
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["PET_NNODES"] == "2:2" and "SGDJOB_TERMINATION_LOG" in env


def _fake(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)


def test_the_pods_check_exits_127_naming_the_field_and_otherwise_execs_an_agent(tmp_path: Path) -> None:
    """The pod's shell line itself, run here: a missing program -> 127 and the termination message;
    our agent where the image's python3 finds sgdjob_trainer, plain torchrun where it does not."""
    main = _pod(["no-such-program-xyz"])["spec"]["containers"][0]
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", "SGDJOB_TERMINATION_LOG": str(log)}
    done = subprocess.run([*main["command"], *main["args"]], env=env, capture_output=True, text=True)
    assert done.returncode == 127
    assert "spec.training.command: no-such-program-xyz was not found" in log.read_text()
    main = _pod(["sh", "-c", "true"])["spec"]["containers"][0]
    plain, ours = tmp_path / "plain", tmp_path / "ours"
    # An image without our package: its python3 (this machine's, outside the venv) lacks it.
    _fake(plain, "torchrun", 'echo "torchrun $*"')
    env["PATH"] = f"{plain}:/usr/bin:/bin"
    done = subprocess.run([*main["command"], *main["args"]], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "torchrun --no-python sh -c true", done.stderr
    # An image with it: a python3 that finds sgdjob_trainer (this venv's) runs our agent.
    _fake(ours, "python3", f'[ "$1" = -c ] && exec {sys.executable} "$@"; echo "python3 $*"')
    env["PATH"] = f"{ours}:{plain}:/usr/bin:/bin"
    done = subprocess.run([*main["command"], *main["args"]], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python3 -m sgdjob_trainer.agent --no-python sh -c true"


def test_a_template_command_is_kept() -> None:
    template = {"spec": {"containers": [{"name": "trainer", "command": ["my-launcher"]}]}}
    main = _pod(COMMAND, template)["spec"]["containers"][0]
    assert main["command"] == ["my-launcher"]


def test_kubectl_describe_says_what_command_mode_turns_off() -> None:
    spec = validate_spec({"replicas": 2, "minReplicas": 1, "training": {"command": COMMAND}})
    plan = plan_reconcile(spec, SGDJobStatus(), [pod(0), pod(1), rdzv()], generation=1, now=T0)
    note = "command mode: the script does not report to SGDJob; mode switches and rebalancing are off"
    assert plan.status.phase is Phase.RUNNING and note in plan.status.message
    assert any(e.reason == "Running" and note in e.message for e in plan.events)


def test_auto_with_a_command_is_a_warning_naming_both_fields() -> None:
    (warning,) = spec_warnings(validate_spec({"replicas": 2, "mode": "auto", "training": {"command": COMMAND}}))
    assert warning.reason == MODE_NOT_ADJUSTABLE
    assert warning.message.startswith("spec.mode: auto cannot adapt spec.training.command: ")
    assert "set spec.mode to sync" in warning.message
    fixed = validate_spec({"replicas": 2, "mode": "sync", "training": {"command": COMMAND}})
    (overridden,) = spec_warnings(fixed.model_copy(update={"mode": JobMode.AUTO}), mode_field="--mode")
    assert overridden.message.startswith("--mode: auto cannot adapt") and "set --mode to sync" in overridden.message


@pytest.mark.parametrize(("mode", "training"), [("sync", {"command": COMMAND}), ("auto", {})])
def test_no_warning_where_the_mode_is_fixed_or_the_trainer_reports(mode: str, training: dict[str, Any]) -> None:
    assert spec_warnings(validate_spec({"replicas": 2, "mode": mode, "training": training})) == []


def _job_file(tmp_path: Path, mode: str, command: list[str]) -> Path:
    spec = {"replicas": 2, "mode": mode, "training": {"command": command}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob",
                                    "metadata": {"name": "mine"}, "spec": spec}))  # fmt: skip
    return path


def test_validate_and_run_print_the_warning_and_validate_still_passes(tmp_path: Path) -> None:
    path = _job_file(tmp_path, "auto", ["no-such-trainer-xyz"])
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0 and "SGDJob mine is valid" in result.stdout
    assert f"{path}: warning: spec.mode: auto cannot adapt spec.training.command" in result.stderr
    # `sgdjob run` says it before anything else (here the missing program then stops it, exit 2).
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"{path}: warning: spec.mode: auto cannot adapt spec.training.command")
    assert "spec.training.command[0]: 'no-such-trainer-xyz' was not found on PATH" in result.stderr
    result = CliRunner().invoke(main, ["run", str(path), "--mode", "sync"])  # the override fixes it
    assert result.exit_code == 2 and "warning" not in result.stderr
