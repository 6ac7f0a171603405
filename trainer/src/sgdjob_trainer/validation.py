"""Validation on the held-out split (data.held_out_indices) and the job's quality target.

Rank 0 evaluates between steps, outside a strategy's step, so the time is neither compute nor
communication wait in the telemetry (the straggler signal); it is counted on its own
(sgdjob_validation_seconds_total). In sync and hierarchical mode the other ranks wait for rank 0 at
the next exchange, which they count as wait, as for any pause of rank 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgdjob_trainer.config import Evaluation, Target, TargetMetric
from sgdjob_trainer.networks import LossFn


@dataclass(slots=True, frozen=True)
class Validation:
    loss: float
    accuracy: float | None  # None unless the loss is cross-entropy (classification)
    seconds: float


def reached(target: Target, result: Validation) -> bool:
    """Whether one validation meets the target (accuracy at or above it, loss at or below)."""
    if target.metric == TargetMetric.ACCURACY:
        return result.accuracy is not None and result.accuracy >= target.value
    return result.loss <= target.value


class Validator:
    """Evaluates a model on fixed held-out samples; `due` says when, by steps or seconds."""

    def __init__(self, cfg: Evaluation, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> None:
        self.cfg, self.x, self.y, self.loss_fn = cfg, x, y, loss_fn
        self.classification = loss_fn is F.cross_entropy
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
                    accuracy = float((out.argmax(dim=1) == self.y).float().mean())
        finally:
            model.train(was_training)
        self.last = time.monotonic()
        return Validation(loss, accuracy, time.perf_counter() - start)
