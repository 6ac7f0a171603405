"""Validation on the held-out split (data.held_out_indices) and the job's quality target.

Rank 0 evaluates between steps, outside a strategy's step, so the time is neither compute nor
communication wait in the telemetry (the straggler signal); it is counted on its own
(sgdjob_validation_seconds_total). In sync and hierarchical mode the other ranks wait for rank 0 at
the next exchange, which they count as wait, as for any pause of rank 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from sgdjob_trainer.config import Evaluation, Target, TargetMetric
from sgdjob_trainer.hooks import load_hook
from sgdjob_trainer.networks import LossFn


@dataclass(slots=True, frozen=True)
class Validation:
    loss: float
    accuracy: float | None  # None unless the loss is cross-entropy (classification)
    seconds: float
    metric: float | None = None  # evaluation.metric's value, when the job names one


# What a metric hook is called with: the model's outputs on the held-out samples and their targets.
MetricFn = Callable[[torch.Tensor, torch.Tensor], Any]


def reached(target: Target, result: Validation) -> bool:
    """Whether one validation meets the target (accuracy at or above it, loss at or below, the user's
    metric at or above it, or at or below with `minimize`)."""
    if target.metric == TargetMetric.ACCURACY:
        return result.accuracy is not None and result.accuracy >= target.value
    if target.metric == TargetMetric.METRIC:
        if result.metric is None or not math.isfinite(result.metric):
            return False
        return result.metric <= target.value if target.minimize else result.metric >= target.value
    return result.loss <= target.value


def load_metric(spec: str) -> MetricFn:
    """Resolve evaluation.metric; an error names the field."""
    try:
        fn = load_hook(spec)
    except (ImportError, ValueError) as err:
        raise ValueError(f"training.evaluation.metric: cannot load '{spec}': {err}") from err
    if not callable(fn):
        raise ValueError(f"training.evaluation.metric: '{spec}' is not a function of (outputs, targets)")
    return cast(MetricFn, fn)


def metric_value(fn: MetricFn, spec: str, out: torch.Tensor, y: torch.Tensor) -> float:
    """The hook's value as a float; an error names the field and what came back."""
    value = fn(out, y)
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"training.evaluation.metric: '{spec}' returned {type(value).__name__}, not a number "
            "(return a float or a one-element tensor)"
        ) from err


def predicted_classes(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The argmax over the output's class dimension: the last one when the output is the target's
    shape plus classes ([B, T, V] against [B, T]), else dimension 1 (cross_entropy's convention)."""
    return out.argmax(dim=-1) if out.shape[:-1] == y.shape else out.argmax(dim=1)


class Validator:
    """Evaluates a model on fixed held-out samples; `due` says when, by steps or seconds."""

    def __init__(
        self,
        cfg: Evaluation,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: LossFn,
        classification: bool,
        task_metric: MetricFn | None = None,
    ) -> None:
        self.cfg, self.x, self.y, self.loss_fn = cfg, x, y, loss_fn
        self.classification = classification
        # evaluation.metric wins over the task's own metric.
        self.metric_fn = load_metric(cfg.metric) if cfg.metric is not None else task_metric
        self.metric_name = cfg.metric or "Task.metric"
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        every_steps, every_seconds = self.cfg.every_steps, self.cfg.every_seconds
        by_steps = every_steps is not None and step % every_steps == 0
        by_time = every_seconds is not None and time.monotonic() - self.last >= every_seconds
        return len(self.y) > 0 and (by_steps or by_time)

    def run(self, model: torch.nn.Module) -> Validation:
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(self.x)
                loss = float(self.loss_fn(out, self.y))
                accuracy = None
                if self.classification and len(self.y) > 0:
                    accuracy = float((predicted_classes(out, self.y) == self.y).float().mean())
                metric = None
                if self.metric_fn is not None and len(self.y) > 0:
                    metric = metric_value(self.metric_fn, self.metric_name, out, self.y)
        finally:
            model.train(was_training)
        self.last = time.monotonic()
        return Validation(loss, accuracy, time.perf_counter() - start, metric)
