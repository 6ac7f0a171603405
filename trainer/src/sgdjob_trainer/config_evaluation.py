"""Evaluation settings of `spec.training`: the held-out validation schedule and the quality target
that ends a job as Succeeded.

Free of torch, like `sgdjob_trainer.config`, which re-exports every name here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import Field, model_validator

from sgdjob_trainer.config_base import HOOK_PATTERN, CamelModel, cross_field_error


class TargetMetric(StrEnum):
    ACCURACY = "accuracy"
    LOSS = "loss"
    METRIC = "metric"  # the user's evaluation.metric hook


class Evaluation(CamelModel):
    """Validation on a held-out split of the dataset that no rank trains on (the same samples in
    every run of a dataset). Rank 0 evaluates between steps; its time is not counted as compute."""

    every_steps: Annotated[
        int | None,
        Field(ge=1, le=1_000_000_000, description="Steps between validations on rank 0; omit for none by steps."),
    ] = 50
    every_seconds: Annotated[
        float | None,
        Field(
            ge=0.1,
            le=86_400.0,
            description="Seconds of training between validations on rank 0 (also); omit for none by time.",
        ),
    ] = None
    samples: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000,
            description=(
                "Held-out samples, excluded from training and evaluated each time "
                "(at most a fifth of the dataset is held out)."
            ),
        ),
    ] = 256
    metric: Annotated[
        str | None,
        Field(
            max_length=256,
            pattern=HOOK_PATTERN,
            description=(
                "A 'module:function' called as f(outputs, targets) -> float on the held-out samples at each "
                "validation (e.g. F1, perplexity); reported beside loss and accuracy, and a target can use it."
            ),
        ),
    ] = None


class Target(CamelModel):
    """A quality goal: the job succeeds (reason TargetReached) once rank 0's validation reaches it."""

    metric: Annotated[
        TargetMetric,
        Field(
            description=(
                "accuracy (reached at or above value; classification only), loss (at or below value) or metric "
                "(evaluation.metric's value, at or above value; at or below with minimize)."
            )
        ),
    ]
    value: Annotated[
        float, Field(ge=-1e6, le=1e6, description="The validation accuracy (0..1), loss or metric value to reach.")
    ]
    minimize: Annotated[
        bool, Field(description="metric only: the target is reached at or below value (lower is better).")
    ] = False

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.metric == TargetMetric.ACCURACY and not 0.0 < self.value <= 1.0:
            raise cross_field_error("value", f"an accuracy target must be in (0, 1], not {self.value}")
        if self.metric == TargetMetric.LOSS and self.value < 0:
            raise cross_field_error("value", f"a loss target must be 0 or more, not {self.value}")
        if self.minimize and self.metric != TargetMetric.METRIC:
            raise cross_field_error("minimize", "minimize applies to a metric target only (loss is always minimized)")
        return self
