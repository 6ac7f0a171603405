"""spec.training.adaptation: api, a command-mode script on the adaptation API, as the shells see it:
validated, no command-mode note or auto warning, the policy on (rebalance, a switch to hierarchical
where the ranks say they can, never async, never a trimmed batch), the
run-config's path in every worker's environment, locally and on Kubernetes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sgdjob_operator.api.models import Action, Phase, SGDJob, SGDJobStatus
from sgdjob_operator.api.validation import SpecError, spec_warnings, validate_spec
from sgdjob_operator.k8s.builders import JobRef, build_worker_pod
from sgdjob_operator.k8s.plan import plan_reconcile
from sgdjob_operator.local.command_mode import run_note
from sgdjob_operator.local.launch import plan_launch
from sgdjob_operator.local.runner import RunOptions, run_mode
from sgdjob_operator.policy import SwitchMode
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.job import job_view
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.launch_contract import ADAPTATION_API_NOTE, COMMAND_MODE_NOTE, ENV_RUN_CONFIG
from tests.unit.test_policy_harness import Harness
from tests.unit.test_policy_mode_check import IN_SYNC, SPEEDS, switches
from tests.unit.test_status import T0, pod, rdzv

API = {"command": ["python", "train.py"], "adaptation": "api"}


def _spec(mode: str = "auto", **training: Any) -> dict[str, Any]:
    return {"replicas": 2, "minReplicas": 1, "mode": mode, "training": {**API, **training}}


def _problems(spec: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as err:
        validate_spec(spec)
    return "\n".join(err.value.problems)


def test_the_api_is_for_a_command_and_starts_in_sync_auto_or_async() -> None:
    text = _problems({"replicas": 2, "training": {"adaptation": "api"}})
    assert "spec.training.adaptation" in text and "training.command" in text
    text = _problems(_spec("hierarchical"))
    assert "spec.mode" in text and "starts in sync or async, not hierarchical" in text and "set mode to auto" in text
    assert validate_spec(_spec("sync")).training.on_adaptation_api
    assert validate_spec(_spec("async")).mode.value == "async"
    assert "spec.training.adaptation" in _problems(_spec(adaptation="later"))


def test_auto_on_the_api_is_no_warning_and_not_the_command_mode_note() -> None:
    spec = validate_spec(_spec())
    assert spec_warnings(spec) == []
    assert spec_warnings(validate_spec({"replicas": 2, "training": {"command": ["python", "t.py"]}}))
    plan = plan_reconcile(spec, SGDJobStatus(), [pod(0), pod(1), rdzv()], generation=1, now=T0)
    assert plan.status.phase is Phase.RUNNING and COMMAND_MODE_NOTE not in (plan.status.message or "")
    assert run_note(Path("/w"), api=True).startswith(ADAPTATION_API_NOTE)


def test_the_policy_may_rebalance_a_script_on_the_api_and_switch_its_mode_but_never_trim_its_batch() -> None:
    every = {"policy": {"allowedActions": [a.value for a in Action]}, "maxReplicas": 3}
    view = job_view(validate_spec({**_spec(), **every}), step=10_000)
    assert view.auto and view.allows(Action.REBALANCE) and view.allows(Action.REPLACE_WORKER)
    assert view.allows(Action.RESCALE) and view.allows(Action.SWITCH_MODE)
    assert not view.allows(Action.TRIM_BATCH)
    assert view.steps_left is None, "the script's own arguments decide its length, not training.steps"
    trainer = job_view(validate_spec({"replicas": 2, "mode": "auto"}), step=10)
    assert trainer.allows(Action.SWITCH_MODE) and trainer.steps_left == 990


def _job(spec: dict[str, Any]) -> SGDJob:
    doc = {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "byoc"}, "spec": spec}
    return SGDJob.model_validate(doc)


def test_sgdjob_run_drives_a_script_on_the_api_and_tells_it_its_run_config(tmp_path: Path) -> None:
    job = _job(_spec())
    assert run_mode(job, RunOptions(out_dir=tmp_path)) == (SyncMode.SYNC, True)
    silent = _job({"replicas": 2, "mode": "auto", "training": {"command": ["python", "t.py"]}})
    assert run_mode(silent, RunOptions(out_dir=tmp_path)) == (SyncMode.SYNC, False)
    base = {ENV_RUN_CONFIG: "/elsewhere/run-config.json"}  # e.g. `sgdjob run` started inside a job
    ports: dict[str, Any] = {"rdzv_port": 29000, "metrics_bases": [30000, 30010], "token": "t"}
    plan = plan_launch(job, SyncMode.SYNC, tmp_path, python="python", base_env=base, work_dir=tmp_path, **ports)
    for agent in plan.agents:
        assert agent.env[ENV_RUN_CONFIG] == str(agent.config_path)
        assert agent.run_config.training.metrics_port == agent.metrics_ports[0]


def test_worker_pods_name_the_mounted_run_config() -> None:
    spec = validate_spec(_spec())
    main = build_worker_pod(JobRef("byoc", "default", "uid-1"), spec, 0, default_image="img")["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    mount = next(m for m in main["volumeMounts"] if m["name"] == "sgdjob-config")
    assert env[ENV_RUN_CONFIG] == f"{mount['mountPath']}/run-config.json"


def _script_in_two_speed_clusters(hierarchical_capable: bool) -> list[SwitchMode]:
    """Six ranks in two speed clusters on a slow network, where the policy takes a trainer's job to
    hierarchical (tests/unit/test_policy_mode_check.py), as a script on the API that never runs async
    (its sessions report sgdjob_async_capable 0) and says whether it can run hierarchical."""
    h = Harness(
        list(SPEEDS),
        jitter=0.3,
        noise=0.02,
        async_capable=False,
        hierarchical_capable=hierarchical_capable,
        comm=CommModel(latency_s=0.05, gradient_bytes=0),
        training=API,
        mode_gradients={"sync": IN_SYNC, "hierarchical": IN_SYNC},
    )
    for _ in range(8):
        h.step()
    return [d for _, d in switches(h)]


def test_the_policy_takes_a_script_to_hierarchical_only_where_its_ranks_say_they_can() -> None:
    able = _script_in_two_speed_clusters(True)
    assert able and able[0].mode == "hierarchical" and able[0].groups is not None, able
    assert all(d.mode != "async" for d in able)
    assert all(d.mode != "hierarchical" for d in _script_in_two_speed_clusters(False))
