"""The held-out validation split: deterministic, and disjoint from every rank's training shard."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.data import ShardedStream, digits_dataset, held_out_batch, held_out_indices, synthetic_dataset
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire import metric_names as wm
from sgdjob_trainer.wire.worker_status import TARGET_REACHED, WorkerStatus


def _read_epochs(stream: ShardedStream, epochs: int, batch: int) -> set[int]:
    stream.trace = []
    while stream.position.epoch < epochs:
        stream.next_batch(batch)
    return set(stream.trace)


@pytest.mark.parametrize(
    "dataset", [synthetic_dataset(), digits_dataset(), TensorDataset(torch.arange(40.0), torch.arange(40))]
)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_no_rank_trains_on_the_held_out_split(dataset: TensorDataset, world: int) -> None:
    size = len(dataset)
    held = held_out_indices(size, 256)
    assert len(held) == min(256, size // 5) and len(set(held.tolist())) == len(held)
    trained: set[int] = set()
    for rank in range(world):
        stream = ShardedStream(dataset, rank, world, seed=11, held_out=held)
        assert stream.size == size - len(held)
        seen = _read_epochs(stream, 2, 2)
        assert not seen & set(held.tolist()), f"rank {rank} trained on held-out samples"
        trained |= seen
    # Everything not held out is still trained on (up to each epoch's dropped tails).
    assert len(trained) >= size - len(held) - 2 * world * 2


def test_the_split_is_fixed_by_the_data_seed_not_the_training_seed() -> None:
    ds = digits_dataset()
    assert torch.equal(held_out_indices(len(ds), 100), held_out_indices(len(ds), 100))
    # More samples extend the split; the training seed plays no part in it.
    assert set(held_out_indices(len(ds), 50).tolist()) <= set(held_out_indices(len(ds), 100).tolist())
    x, y = held_out_batch(ds, 100)
    assert torch.equal(x, ds.tensors[0][held_out_indices(len(ds), 100)]) and len(y) == 100
    a = ShardedStream(ds, 0, 2, seed=1, held_out=held_out_indices(len(ds), 100))
    b = ShardedStream(ds, 0, 2, seed=2, held_out=held_out_indices(len(ds), 100))
    assert not torch.equal(a._shard_for(0), b._shard_for(0)), "the training seed still orders the data"


def test_validation_figures_reach_metrics_status_and_the_rank_report() -> None:
    info = WorldInfo(0, local_rank=0, world_size=2, local_world_size=2, group_rank=0, restart_count=0, node="n")
    telemetry = Telemetry(info, SyncMode.SYNC, batch_size=8)
    assert not {"validationLoss", "timeToTargetS", "endReason"} & set(telemetry.status().document())
    telemetry.record_validation(0, 2.5, 0.1, seconds=0.5)
    telemetry.record_step(1, samples=8, compute_s=0.25, wait_s=0.0, step_s=0.3, loss=2.0, staleness=0.0)
    telemetry.record_validation(1, 1.5, 0.75, seconds=0.25)
    telemetry.record_target(1)
    telemetry.record_validation(1, 1.25, 0.8, seconds=0.25)  # the final one, at the same step: replaces it
    status = WorkerStatus.model_validate(telemetry.status().document())
    assert (status.validation_loss, status.validation_accuracy, status.validation_step) == (1.25, 0.8, 1)
    assert status.end_reason == TARGET_REACHED and status.target_step == 1
    assert status.time_to_target_s is not None and status.time_to_target_s >= 0
    metrics = telemetry.render_metrics().decode()
    assert f"{wm.VALIDATION_LOSS} 1.25" in metrics and f"{wm.VALIDATION_ACCURACY} 0.8" in metrics
    assert f"{wm.sample_name(wm.VALIDATION_SECONDS)} 1.0" in metrics
    assert f"{wm.sample_name(wm.COMPUTE_SECONDS)} 0.25" in metrics, "validation time is not compute"
    history = json.loads(json.dumps(telemetry.summary()))["validationHistory"]
    assert [[p[0], p[1], p[2], p[4]] for p in history] == [[0, 2.5, 0.1, 0], [1, 1.25, 0.8, 8]]


def test_a_metric_hook_is_checked_where_the_job_is_written_and_where_it_runs() -> None:
    from sgdjob_trainer.config import TrainingConfig
    from sgdjob_trainer.validation import Validation, Validator, reached

    base = {"model": "digits-mlp", "dataset": "digits"}
    with pytest.raises(ValueError, match="a metric target needs evaluation"):
        TrainingConfig.model_validate({**base, "target": {"metric": "metric", "value": 0.5}})
    with pytest.raises(ValueError, match="minimize"):
        TrainingConfig.model_validate({**base, "target": {"metric": "loss", "value": 0.5, "minimize": True}})
    with pytest.raises(ValueError, match=r"evaluation\.metric"):
        TrainingConfig.model_validate({**base, "evaluation": {"metric": "not a hook"}})
    cfg = TrainingConfig.model_validate(
        {
            **base,
            "evaluation": {"metric": "torch.nn.functional:l1_loss"},
            "target": {"metric": "metric", "value": 1.0, "minimize": True},
        }
    )
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    validator = Validator(cfg.evaluation, x, y, torch.nn.functional.mse_loss, False)
    result = validator.run(torch.nn.Identity())
    assert result.metric == pytest.approx(float((x - y).abs().mean()))
    assert cfg.target is not None and reached(cfg.target, result) == (result.metric <= 1.0)
    assert not reached(cfg.target, Validation(0.0, None, 0.0, None)), "no metric value: not reached"
    bad = cfg.evaluation.model_copy(update={"metric": "torch.nn.functional:missing"})
    with pytest.raises(ValueError, match=r"training\.evaluation\.metric: cannot load"):
        Validator(bad, x, y, torch.nn.functional.mse_loss, False)
    odd = cfg.evaluation.model_copy(update={"metric": "builtins:zip"})
    with pytest.raises(ValueError, match="returned zip, not a number"):
        Validator(odd, x, y, torch.nn.functional.mse_loss, False).run(torch.nn.Identity())
