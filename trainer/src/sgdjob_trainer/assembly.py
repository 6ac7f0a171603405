"""From the job's task to what the training loop runs: the model on its device (one model on every
rank), the optimizer and its schedule, this rank's data stream and the validation samples.

Errors a user makes here are reported with the field (or the task) and the fix, before any step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from sgdjob_trainer.config import TrainingConfig
from sgdjob_trainer.data import DataPosition, ShardedStream, fetch, held_out_indices
from sgdjob_trainer.levers import lr_factor
from sgdjob_trainer.optim import build_optimizer, check_optimizer, remember_base_lrs
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.streaming import IterableStream
from sgdjob_trainer.task import Data, Task, dataset_size, is_stream, resolve_task

Stream = ShardedStream | IterableStream


@dataclass
class Parts:
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], float]  # multiplier of every group's base learning rate at a step
    stream: Stream
    eval_x: torch.Tensor
    eval_y: torch.Tensor


def assemble(
    training: TrainingConfig,
    info: WorldInfo,
    device: torch.device,
    position: DataPosition,
    group: dist.ProcessGroup | None,
) -> Parts:
    """Collective (the model check and broadcast): the job's parts on this rank."""
    where = f"training.task '{training.task}'" if training.task else "training.model"
    task = resolve_task(training)
    model = task.model.to(device)
    same_model(model, info.world_size, group, where)
    # A model built randomly on each rank need not match: rank 0's values are everyone's start.
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    optimizer = _optimizer(training, task, model)
    remember_base_lrs(optimizer)
    stream, eval_x, eval_y = _data(training, task, info, position)
    return Parts(task, model, optimizer, _schedule(training, task), stream, eval_x.to(device), eval_y.to(device))


def same_model(model: nn.Module, world_size: int, group: dist.ProcessGroup | None, where: str) -> None:
    """Collective: raise on every rank when the ranks built different architectures."""
    mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            differ = next((a, b) for a, b in itertools.zip_longest(mine, theirs) if a != b)
            raise ValueError(
                f"{where}: the model differs between ranks (this rank has {differ[0]}, rank {rank} has "
                f"{differ[1]}); build the same architecture on every rank, without rank- or host-dependent choices"
            )


def _optimizer(training: TrainingConfig, task: Task, model: nn.Module) -> torch.optim.Optimizer:
    if task.optimizer is None:
        return build_optimizer(training, model)
    # By value (a run-config file carries every field written out): anything off its default.
    for field in ("learning_rate", "momentum", "optimizer"):
        if getattr(training, field) != TrainingConfig.model_fields[field].default:
            name = {"learning_rate": "learningRate"}.get(field, field)
            raise ValueError(
                f"training.{name}: the task builds its own optimizer, which sets the learning rates; "
                f"remove training.{name} or drop Task.optimizer"
            )
    return check_optimizer(task.optimizer(model), model, f"training.task '{training.task}'")


def _schedule(training: TrainingConfig, task: Task) -> Callable[[int], float]:
    if task.lr_lambda is None:
        return lambda step: lr_factor(training.lr_policy, step, training.steps)
    if training.lr_policy != TrainingConfig.model_fields["lr_policy"].default:
        raise ValueError(
            "training.lrPolicy: the task gives lr_lambda, its own schedule; remove training.lrPolicy or lr_lambda"
        )
    fn = task.lr_lambda
    return lambda step: float(fn(step))


def _first(data: Data, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` items of a dataset or stream, collated."""
    if is_stream(data):
        items = list(itertools.islice(iter(cast(Any, data)), count))
    else:
        items = [cast(Any, data)[i] for i in range(min(count, dataset_size(data)))]
    if not items:
        raise ValueError("training.task: validation_data is empty")
    x, y = default_collate(items)
    return x, y


def _data(
    training: TrainingConfig, task: Task, info: WorldInfo, position: DataPosition
) -> tuple[Stream, torch.Tensor, torch.Tensor]:
    samples = training.evaluation.samples
    train = task.train_data
    if is_stream(train):
        stream: Stream = IterableStream(cast(Any, train), info.rank, info.world_size, position)
    else:
        size = dataset_size(train)
        held_out = held_out_indices(size, samples) if task.validation_data is None else None
        sharded = ShardedStream(train, info.rank, info.world_size, training.seed, position, held_out=held_out)
        per_rank = sharded.size // info.world_size
        if per_rank < training.batch_size:
            raise ValueError(
                f"training.batchSize: {sharded.size} training samples over {info.world_size} worker processes leave "
                f"{per_rank} per rank, fewer than batchSize {training.batch_size}; use a smaller batchSize, fewer "
                "workers or a larger dataset"
            )
        stream = sharded
        if held_out is not None:
            x, y = fetch(train, held_out)
            return stream, x, y
    assert task.validation_data is not None  # task.load_task requires it for a stream
    x, y = _first(task.validation_data, samples)
    return stream, x, y
