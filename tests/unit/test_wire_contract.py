"""The trainer/controller contract (sgdjob_trainer.wire), checked end to end: what the trainer's own
code produces is what the controllers' parsers read, with nothing written by hand in between."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from sgdjob_operator.api.models import SGDJob
from sgdjob_operator.api.validation import validate_job
from sgdjob_operator.k8s.builders import CONFIG_FILE, JobRef, build_config_map, build_worker_pod
from sgdjob_operator.local.launch import AgentPlan, plan_launch
from sgdjob_operator.policy.measure import measure
from sgdjob_operator.policy.samples import GradientSignal, WorkerSample
from sgdjob_operator.workers.scrape import Endpoint, parse_metrics, parse_status, sample_from_status
from sgdjob_trainer.config import Compression, SyncMode
from sgdjob_trainer.gradient_stats import GradientFigures
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.server import TrainerServer
from sgdjob_trainer.strategies.base import exchange_bytes
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire.launch_contract import AGENT_MODULE, RunConfig, option_env
from sgdjob_trainer.wire.worker_status import CheckpointReport, Figures, ResumeRecord


def _telemetry(rank: int = 1) -> Telemetry:
    info = WorldInfo(rank, local_rank=1, world_size=3, local_world_size=2, group_rank=0, restart_count=0, node="node-b")
    return Telemetry(info, SyncMode.ASYNC, batch_size=16)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    model[0].bias.requires_grad_(False)  # frozen: never exchanged
    return model


@pytest.mark.parametrize("compression", list(Compression))
def test_gradient_bytes_are_the_bytes_the_allreduce_sends(compression: Compression) -> None:
    model = _model()
    model(torch.randn(4, 6)).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    sent = grads.to(torch.bfloat16) if compression == Compression.BF16 else grads
    assert exchange_bytes(list(model.parameters()), compression) == sent.numel() * sent.element_size()


def test_the_trainers_metrics_give_the_policy_every_field_it_reads() -> None:
    telemetry = _telemetry()
    nbytes = exchange_bytes(list(_model().parameters()), Compression.NONE)
    telemetry.set_gradient_bytes(nbytes)
    text = telemetry.render_metrics().decode()
    assert parse_metrics(text, time=1.0).training_seconds is None, "before training began, its start is not known"
    telemetry.begin_training()
    for step in (1, 2, 3):
        telemetry.record_step(step, samples=16, compute_s=0.5, wait_s=0.25, step_s=0.8, loss=0.75, staleness=2.0)
    telemetry.set_gradient_figures(GradientFigures(12, sq_norm=0.5, variance=40.0, lag_dot=0.25))
    telemetry.adaptive = True  # an Adam-family optimizer
    endpoint = Endpoint("http://10.0.0.9:9401", pod="job-worker-0", rank=7, node="hint")
    before = telemetry.training_seconds()
    sample = parse_metrics(telemetry.render_metrics().decode(), time=50.0, endpoint=endpoint)
    after = telemetry.training_seconds()
    assert sample.training_seconds is not None and before <= sample.training_seconds <= after
    expected = WorkerSample(
        rank=1,
        time=50.0,
        steps=3,
        samples=48,
        compute_seconds=1.5,
        comm_wait_seconds=0.75,
        mode="async",
        batch_size=16,
        node="node-b",
        pod="job-worker-0",
        loss=0.75,
        staleness=2.0,
        world_size=3,
        gradient_bytes=nbytes,
        training_seconds=sample.training_seconds,
        gradient=GradientSignal(12, 0.5, 40.0, 0.25),
        stalled_seconds=sample.stalled_seconds,
        computing=False,
        async_capable=True,
        hierarchical_capable=True,
        adaptive_optimizer=True,
    )
    assert sample.stalled_seconds is not None and 0 <= sample.stalled_seconds <= after
    assert sample == expected
    zero = WorkerSample(0, 0.0, steps=0, samples=0, compute_seconds=0.0, comm_wait_seconds=0.0, mode="", batch_size=0)
    unset = [f.name for f in dataclasses.fields(WorkerSample) if getattr(sample, f.name) == getattr(zero, f.name)]
    assert unset == [], "every field the policy reads comes from the trainer's metrics"
    telemetry.async_capable = False  # an optimizer async mode cannot shard
    assert parse_metrics(telemetry.render_metrics().decode(), time=51.0).async_capable is False
    telemetry.hierarchical_capable = False  # a script on the adaptation API that cannot run hierarchical
    assert parse_metrics(telemetry.render_metrics().decode(), time=51.0).hierarchical_capable is False
    window = measure({}, [sample], world_size=3)
    assert window.gradient_bytes == nbytes and window.world_size == 3


def _served_status(telemetry: Telemetry) -> bytes:
    server = TrainerServer(telemetry, None, "127.0.0.1", 0)
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/status", timeout=5) as resp:
            body: bytes = resp.read()
            return body
    finally:
        server.stop()


def test_the_served_status_parses_into_the_model_and_back() -> None:
    telemetry = _telemetry(rank=0)
    telemetry.record_step(1, samples=16, compute_s=0.5, wait_s=0.25, step_s=0.8, loss=float("nan"), staleness=0.0)
    telemetry.record_switch(SyncMode.ASYNC, SyncMode.SYNC, 1, 0.125, "stragglers gone")
    telemetry.set_control_epoch(4, "mode hierarchical refused")
    telemetry.restart_count = 1
    resume = ResumeRecord(from_step=0, reached_step=3, lost_steps=3, restart_seconds=1.5, world_size=3, restart_count=1)
    telemetry.resumes = [resume]
    figures = Figures.of([0.5, 1.5])
    telemetry.checkpoint = CheckpointReport(stall_seconds=figures, write_seconds=Figures.of([]), completed=[1])
    telemetry.set_gradient_figures(GradientFigures(15, sq_norm=2.0, variance=64.0, lag_dot=None))
    body = _served_status(telemetry)
    status = parse_status(body.decode())
    assert status.document() == json.loads(body), "nothing the trainer serves is lost or added by the model"
    assert (status.rank, status.control_epoch, status.loss, status.restart_count) == (0, 4, None, 1)
    assert status.control_error == "mode hierarchical refused"
    assert status.port is not None and status.checkpoint is not None and status.checkpoint.stall_seconds.mean == 1.0
    assert [s.to_mode for s in status.switches] == [SyncMode.SYNC] and status.resumes == telemetry.resumes
    from_status = sample_from_status(status, time=1.0)
    assert from_status.mode == "sync" and from_status.gradient == GradientSignal(15, 2.0, 64.0, None)


def test_a_fresh_trainers_status_leaves_out_what_it_does_not_know_yet() -> None:
    doc = json.loads(_served_status(_telemetry()))
    assert not {"restartCount", "resumes", "checkpoint", "gradientSqNorm", "gradientLagDot", "controlError"} & set(doc)
    assert sample_from_status(parse_status(json.dumps(doc)), time=1.0).gradient is None
    assert parse_status(json.dumps(doc)).document() == doc


def _job(mode: str, actions: list[str]) -> SGDJob:
    spec = {"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "nprocPerNode": 2, "mode": mode,
            "runPolicy": {"backoffLimit": 2}, "policy": {"allowedActions": actions}}  # fmt: skip
    doc = {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "tiny"}, "spec": spec}
    return validate_job(doc)


def _agent(job: SGDJob, tmp_path: Path, *, auto: bool) -> AgentPlan:
    plan = plan_launch(
        job,
        SyncMode.SYNC,
        tmp_path,
        rdzv_port=29555,
        metrics_bases=[30000, 30010],
        token="t",
        python="/py",
        base_env={},
        auto=auto,
    )
    return plan.agents[0]


def _agent_options(argv: tuple[str, ...]) -> dict[str, str]:
    """The agent's torchrun options (between the agent module and the worker's `-m`), named as in the env."""
    options = argv[argv.index(AGENT_MODULE) + 1 : argv.index("-m", argv.index(AGENT_MODULE))]
    return {option_env(name.removeprefix("--")): value for name, value in (o.split("=", 1) for o in options)}


def test_a_pod_and_a_local_agent_of_one_job_start_the_same_trainers(tmp_path: Path) -> None:
    job = _job("auto", ["switchMode", "replaceWorker"])
    pod = build_worker_pod(JobRef("tiny", "ns", "u-1"), job.spec, 0, default_image="img")
    container = pod["spec"]["containers"][0]
    pod_options = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("PET_")}
    agent = _agent(job, tmp_path, auto=True)
    local_options = _agent_options(agent.argv)
    assert set(pod_options) == set(local_options), "the same torchrun options, as env in a pod and argv locally"
    differ = {name for name in pod_options if pod_options[name] != local_options[name]}
    where = {option_env(o) for o in ("rdzv-endpoint", "rdzv-id", "rdzv-conf", "local-addr")}
    assert differ == where, "only where they run differs"
    assert local_options[option_env("max-restarts")] == "5" and local_options[option_env("nnodes")] == "1:3"
    conf = option_env("rdzv-conf")
    assert pod_options[conf].startswith("is_host=0,") and local_options[conf].startswith("is_host=0,"), "store apart"
    assert container["args"][:3] == list(agent.argv[-4:-1]) == ["-m", "sgdjob_trainer", "--config"]
    # A local run whose policy never removes a worker budgets no restarts for members leaving.
    fixed = _agent_options(_agent(_job("sync", ["switchMode", "replaceWorker"]), tmp_path, auto=False).argv)
    assert fixed[option_env("max-restarts")] == "2"


def test_a_pod_and_a_local_agent_read_the_same_run_config(tmp_path: Path) -> None:
    job = _job("sync", ["switchMode"])
    config_map = build_config_map(JobRef("tiny", "ns", "u-1"), job.spec, SyncMode.SYNC)
    in_pod = RunConfig.model_validate_json(config_map["data"][CONFIG_FILE])
    local = _agent(job, tmp_path, auto=False).run_config
    facts = (local.job_name, local.mode, local.reference_world_size)
    assert facts == (in_pod.job_name, in_pod.mode, in_pod.reference_world_size) == ("tiny", SyncMode.SYNC, 2)
    # Locally, only the run's own port and checkpoint directory differ from the spec's training.
    assert local.training.model_copy(update={"metrics_port": in_pod.training.metrics_port}) == in_pod.training
