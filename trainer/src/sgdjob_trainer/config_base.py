"""The shared pieces of every API model: the camelCase base, the cross-field error and the enums that
the trainer and the operator both name (sync modes, learning-rate rules, precisions).

Free of torch, like `sgdjob_trainer.config`, which re-exports every name here.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

# `package.module:function`, the user-hook form accepted wherever a built-in name is.
HOOK_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
Rank = Annotated[int, Field(ge=0, le=65_535)]


class CamelModel(BaseModel):
    """Base for every API model: camelCase on the wire, snake_case in Python, unknown keys refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=False,
        validate_default=True,
    )


def cross_field_error(field: str, message: str) -> PydanticCustomError:
    """An error for a rule that spans fields; `field` is the path below the validated model."""
    return PydanticCustomError("cross_field", "{message}", {"field": field, "message": message})


class SyncMode(StrEnum):
    """How workers synchronise; `auto` (operator-only) lets the policy choose among these."""

    SYNC = "sync"
    HIERARCHICAL = "hierarchical"
    ASYNC = "async"


class LrScaling(StrEnum):
    LINEAR = "linear"
    SQRT = "sqrt"
    NONE = "none"

    def factor(self, world_size: int, reference_world_size: int) -> float:
        """How much the learning rate at `world_size` is of the one at the reference world size."""
        ratio = world_size / reference_world_size
        if self is LrScaling.LINEAR:
            return ratio
        if self is LrScaling.SQRT:
            return math.sqrt(ratio)
        return 1.0


class StalenessLr(StrEnum):
    NONE = "none"
    INVERSE = "inverse"
    SQRT = "sqrt"

    def factor(self, staleness: float) -> float:
        """The async learning-rate damping of a gradient `staleness` steps old."""
        if self is StalenessLr.INVERSE:
            return 1.0 / (1.0 + staleness)
        if self is StalenessLr.SQRT:
            return 1.0 / math.sqrt(1.0 + staleness)
        return 1.0


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class LrSchedule(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    STEP = "step"


class Compression(StrEnum):
    NONE = "none"
    BF16 = "bf16"


class GroupBy(StrEnum):
    NODE = "node"
    SPEED = "speed"
