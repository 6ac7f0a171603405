"""The task API: what a user's training code hands SGDJob, and how a job's spec becomes one.

A job names one function, `training.task: "package.module:function"`. SGDJob seeds torch with
`training.seed` and calls it with no arguments on every rank; it returns a `Task`. SGDJob keeps the
step: its sync, hierarchical and async strategies run the task's model, loss and optimizer, shard
its data, validate, checkpoint and scale the learning rate with the world size. Without a task the
job's `model`, `dataset` and `loss` fields (built-ins or hooks) and `optimizer` make the same `Task`
(`resolve_task`), so the trainer has one path.

What a task may give and what SGDJob does with it:
- `model`: an `nn.Module`, built the same way on every rank (same architecture; SGDJob then copies
  rank 0's values to all, so a random initialisation need not be reproducible).
- `train_data`: a map-style `Dataset` (sharded by a per-epoch permutation, data.ShardedStream) or an
  `IterableDataset` (a stream, streaming.IterableStream); items are `(input, target)` pairs.
- `validation_data`: held-out data rank 0 validates on (the first `evaluation.samples` items). When
  omitted, a map-style `train_data` gives up a held-out split no rank trains on; a stream cannot, so
  a streaming task must give it.
- `loss(output, target) -> scalar tensor`.
- `optimizer(model) -> torch.optim.Optimizer`: any torch optimizer over exactly the model's trainable
  parameters (parameter groups, weight decay, ...). Its learning rates are the rates at the reference
  world size; SGDJob scales them with `lrScaling` and the schedule. When omitted, `training.optimizer`.
  Async mode runs the optimizer inside the parameter-server shards, so it must keep elementwise state
  (SGD, Adam, AdamW, RMSprop, Adagrad, ...; not Adafactor's factored moments, not LBFGS).
- `lr_lambda(step) -> float`: the multiplier of every group's learning rate at a step (0-based), as
  torch's LambdaLR takes it; replaces `training.lrPolicy`. A function, not a scheduler object, because
  in async mode each parameter-server shard applies it by the pushing worker's step.
- `metric(output, target) -> float`: reported beside the validation loss (`evaluation.metric` wins).
- `classification`: report accuracy (argmax of the output's class dimension); None infers it from a
  cross-entropy loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from sgdjob_trainer.config import TrainingConfig
from sgdjob_trainer.data import build_dataset, fetch
from sgdjob_trainer.hooks import load_hook
from sgdjob_trainer.networks import LossFn, build_loss, build_model

Data = Dataset[Any] | IterableDataset[Any]
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class Task:
    """What a `training.task` function returns (the module doc says what SGDJob does with each)."""

    model: nn.Module
    train_data: Data
    loss: LossFn
    validation_data: Data | None = None
    optimizer: OptimizerFactory | None = None
    lr_lambda: Callable[[int], float] | None = None
    metric: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
    classification: bool | None = None

    def is_classification(self) -> bool:
        return self.classification if self.classification is not None else self.loss is F.cross_entropy


def is_stream(data: object) -> bool:
    return isinstance(data, IterableDataset)


def _check_data(data: object, field: str, spec: str) -> None:
    if is_stream(data):
        return
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TypeError(
            f"training.task: '{spec}' returned {field} of type {type(data).__name__}; give a torch "
            "Dataset (map-style: __getitem__ and __len__) or an IterableDataset of (input, target) pairs"
        )


def load_task(spec: str, seed: int) -> Task:
    """Import and call the task function (seeded); every error names training.task and the fix."""
    try:
        fn = load_hook(spec)
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"training.task: cannot import '{spec}': {err}. The module must be importable in the worker "
            "(installed in its image or on PYTHONPATH)"
        ) from err
    if not callable(fn):
        raise TypeError(f"training.task: '{spec}' is a {type(fn).__name__}, not a function returning a Task")
    torch.manual_seed(seed)
    task = fn()
    if not isinstance(task, Task):
        raise TypeError(
            f"training.task: '{spec}' returned {type(task).__name__}; return sgdjob_trainer.task.Task(model=..., "
            "train_data=..., loss=...)"
        )
    if not isinstance(task.model, nn.Module):
        raise TypeError(f"training.task: '{spec}' returned a Task whose model is {type(task.model).__name__}")
    if not callable(task.loss):
        raise TypeError(f"training.task: '{spec}' returned a Task whose loss is not callable")
    _check_data(task.train_data, "train_data", spec)
    if task.validation_data is not None:
        _check_data(task.validation_data, "validation_data", spec)
    elif is_stream(task.train_data):
        raise ValueError(
            f"training.task: '{spec}' streams its training data (IterableDataset) and gives no validation_data; "
            "a stream has no held-out split, so set Task.validation_data"
        )
    return task


def resolve_task(training: TrainingConfig) -> Task:
    """The job's task: `training.task` when given, else one made of the model, dataset and loss fields."""
    if training.task is not None:
        return load_task(training.task, training.seed)
    dataset = build_dataset(training.dataset)
    model = build_model(training.model, training.seed)
    sample_target = fetch(dataset, torch.zeros(1, dtype=torch.long))[1]
    loss = build_loss(training.loss, training.dataset, sample_target)
    return Task(model=model, train_data=dataset, loss=loss)


def dataset_size(data: Data) -> int:
    return len(cast(Any, data))
