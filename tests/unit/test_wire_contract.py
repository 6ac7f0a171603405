"""The trainer/controller contract (sgdjob_trainer.wire), checked end to end: what the trainer's own
code produces is what the controllers' parsers read, with nothing written by hand in between."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sgdjob_operator.policy.measure import measure
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.workers.scrape import Endpoint, parse_metrics
from sgdjob_trainer.config import Compression, SyncMode
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.strategies.base import exchange_bytes
from sgdjob_trainer.telemetry import Telemetry


def _telemetry(rank: int = 1) -> Telemetry:
    info = WorldInfo(rank=rank, local_rank=1, world_size=3, local_world_size=2, group_rank=0, restart_count=0, node="node-b")
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
    for step in (1, 2, 3):
        telemetry.record_step(step, samples=16, compute_s=0.5, wait_s=0.25, step_s=0.8, loss=0.75, staleness=2.0)
    endpoint = Endpoint("http://10.0.0.9:9401", pod="job-worker-0", rank=7, node="hint")
    sample = parse_metrics(telemetry.render_metrics().decode(), time=50.0, endpoint=endpoint)
    expected = WorkerSample(rank=1, time=50.0, steps=3, samples=48, compute_seconds=1.5, comm_wait_seconds=0.75, mode="async",
                            batch_size=16, node="node-b", pod="job-worker-0", loss=0.75, staleness=2.0, world_size=3,
                            gradient_bytes=nbytes)  # fmt: skip
    assert sample == expected
    defaults = WorkerSample(rank=0, time=0.0, steps=0, samples=0, compute_seconds=0.0, comm_wait_seconds=0.0, mode="", batch_size=0)
    unset = [f.name for f in dataclasses.fields(WorkerSample) if getattr(sample, f.name) == getattr(defaults, f.name)]
    assert unset == [], "every field the policy reads comes from the trainer's metrics"
    window = measure({}, [sample], world_size=3)
    assert window.gradient_bytes == nbytes and window.world_size == 3
