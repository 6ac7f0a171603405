"""The trainer's configuration: `spec.training` of an SGDJob (the file the trainer reads around it is
`sgdjob_trainer.wire.launch.RunConfig`).

This module must stay free of torch: the operator imports it to generate the CRD schema and to
validate specs, and the operator image carries no torch.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

BUILTIN_MODELS = ("mlp", "digits-mlp", "digits-cnn")
BUILTIN_DATASETS = ("synthetic", "digits")
BUILTIN_LOSSES = ("auto", "mse", "cross-entropy")
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


def _hook_or_builtin(value: str, builtins: tuple[str, ...], field: str) -> str:
    if value in builtins or re.match(HOOK_PATTERN, value):
        return value
    raise cross_field_error(
        field, f"'{value}' is neither a built-in ({', '.join(builtins)}) nor a 'module:function' hook"
    )


class SpeedChange(CamelModel):
    """An emulated slowdown: one rank's (or every rank on one node's) compute time is multiplied."""

    rank: Annotated[
        int | None, Field(ge=0, le=65535, description="Global rank that slows down (omit when `node` is given).")
    ] = None
    node: Annotated[
        str | None,
        Field(
            max_length=253, description="Node name whose ranks slow down: a node-bound straggler (the pod's NODE_NAME)."
        ),
    ] = None
    factor: Annotated[
        float,
        Field(ge=0.05, le=100.0, description="Multiplier of the compute time per step: 3 means three times slower."),
    ] = 3.0
    start_step: Annotated[int, Field(ge=0, le=1_000_000_000, description="First step the slowdown applies to.")] = 0
    end_step: Annotated[
        int | None,
        Field(
            ge=1,
            le=1_000_000_000,
            description="Step at which the slowdown ends (exclusive); omit for the rest of the run.",
        ),
    ] = None

    @model_validator(mode="after")
    def _target(self) -> Self:
        if (self.rank is None) == (self.node is None):
            raise cross_field_error("rank", "give exactly one of rank or node for a slowdown")
        if self.end_step is not None and self.end_step <= self.start_step:
            raise cross_field_error(
                "endStep", f"endStep ({self.end_step}) must be greater than startStep ({self.start_step})"
            )
        return self


class Emulation(CamelModel):
    """Emulated accelerator compute for CPU-only machines: each step sleeps instead of computing.

    Off unless given. Gradients are still computed and exchanged for real; only the time a real
    accelerator would spend is replaced by a sleep, so benchmarks measure coordination honestly.
    """

    compute_seconds: Annotated[
        float,
        Field(
            ge=0.0,
            le=60.0,
            description="Emulated compute seconds per step of one worker at factor 1 (for the configured batch size).",
        ),
    ] = 0.05
    jitter: Annotated[
        float,
        Field(
            ge=0.0, le=1.0, description="Relative random noise added to each step's compute time (0.05 = up to +-5%)."
        ),
    ] = 0.0
    slowdowns: Annotated[
        list[SpeedChange],
        Field(max_length=1024, description="Slowdowns by rank or node, optionally limited to a step range."),
    ] = []


class FaultKind(StrEnum):
    CRASH = "crash"
    HANG = "hang"


class Fault(CamelModel):
    """An emulated fault at a step or a time: a crash (the rank exits abruptly, no cleanup, no
    checkpoint) or a hang (the rank blocks for good inside its compute, as behind a wedged GPU or a
    dead file system, until it is killed).

    It fires only in the life named by `restart`: the world's restart count (the highest
    TORCHELASTIC_RESTART_COUNT among its agents, 0 = first start; a replacement pod's fresh agent joins
    peers that count on), so the restarted and replacement workers can get past it. With `everyLife`
    it fires in every life (a crash loop, to exercise runPolicy.backoffLimit).
    """

    kind: Annotated[FaultKind, Field(description="crash (exit abruptly) or hang (block until killed).")] = (
        FaultKind.CRASH
    )
    rank: Annotated[int, Field(ge=0, le=65535, description="Global rank that fails.")] = 0
    at_step: Annotated[
        int | None,
        Field(ge=1, le=1_000_000_000, description="Exit right after this step (omit when afterSeconds is given)."),
    ] = None
    after_seconds: Annotated[
        float | None,
        Field(
            ge=0.0,
            le=86_400.0,
            description="Exit at the first step after this many seconds of training (omit when atStep is given).",
        ),
    ] = None
    exit_code: Annotated[int, Field(ge=1, le=255, description="Exit status of the failing process.")] = 1
    restart: Annotated[
        int, Field(ge=0, le=1000, description="The life it fires in: 0 on the first start, n after the n-th restart.")
    ] = 0
    every_life: Annotated[
        bool,
        Field(
            description=(
                "Fire in every life (every start and restart of the rank), not only in the one `restart` names: "
                "a worker that crash-loops."
            )
        ),
    ] = False

    @model_validator(mode="after")
    def _when(self) -> Self:
        if (self.at_step is None) == (self.after_seconds is None):
            raise cross_field_error("atStep", "give exactly one of atStep or afterSeconds for a fault")
        if self.every_life and self.restart != 0:
            raise cross_field_error("everyLife", "give either restart (one life) or everyLife: true, not both")
        return self

    def fires_in(self, rank: int, restart_count: int) -> bool:
        """Whether this fault applies to `rank` in the life `restart_count` (the world's restart count)."""
        return self.rank == rank and (self.every_life or self.restart == restart_count)


class Checkpoint(CamelModel):
    """Where and how often the trainer saves state it needs to resume."""

    dir: Annotated[
        str | None,
        Field(
            max_length=4096,
            description=(
                "Checkpoint directory, shared by all workers (a shared volume in a cluster). "
                "Omit to disable checkpoints."
            ),
        ),
    ] = None
    interval_steps: Annotated[
        int,
        Field(
            ge=1, le=10_000_000, description="Steps between checkpoints; at most this many steps are lost on a restart."
        ),
    ] = 100
    keep: Annotated[int, Field(ge=1, le=100, description="How many complete checkpoints to retain.")] = 3
    on_stop: Annotated[
        bool,
        Field(
            description="Write a final checkpoint when the workers are asked to stop (SIGTERM) and when training ends."
        ),
    ] = True
    complete_timeout_seconds: Annotated[
        float,
        Field(
            ge=1.0,
            le=86_400.0,
            description="How long rank 0 waits for every rank's part of a checkpoint before abandoning it.",
        ),
    ] = 300.0


class LrPolicy(CamelModel):
    """Learning-rate warmup and decay over the job's steps, on top of the world-size rule."""

    warmup_steps: Annotated[
        int, Field(ge=0, le=1_000_000_000, description="Steps of linear warmup from 0 to the learning rate.")
    ] = 0
    schedule: Annotated[
        LrSchedule,
        Field(
            description=(
                "Decay after warmup: constant, cosine (to minFactor at the last step) "
                "or step (x gamma every stepSize steps)."
            )
        ),
    ] = LrSchedule.CONSTANT
    step_size: Annotated[
        int, Field(ge=1, le=1_000_000_000, description="Steps between decays of the step schedule.")
    ] = 1000
    gamma: Annotated[float, Field(ge=0.0, le=1.0, description="Factor of each decay of the step schedule.")] = 0.1
    min_factor: Annotated[
        float, Field(ge=0.0, le=1.0, description="Fraction of the learning rate the cosine schedule ends at.")
    ] = 0.0


class OptimizerName(StrEnum):
    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


class OptimizerConfig(CamelModel):
    """The declarative optimizer (`training.task` may build any torch optimizer instead). Its learning
    rate is `learningRate`, SGD's momentum is `momentum`; weight decay applies to weights of 2 or
    more dimensions, never to biases or normalisation scales."""

    name: Annotated[OptimizerName, Field(description="sgd (with momentum), adam or adamw.")] = OptimizerName.SGD
    betas: Annotated[
        list[Annotated[float, Field(ge=0.0, lt=1.0)]],
        Field(min_length=2, max_length=2, description="adam/adamw: the moments' decay rates [beta1, beta2]."),
    ] = [0.9, 0.999]
    eps: Annotated[float, Field(gt=0.0, le=1.0, description="adam/adamw: added to the denominator.")] = 1e-8
    weight_decay: Annotated[
        float,
        Field(ge=0.0, le=1.0, description="Weight decay (decoupled for adamw) of weights with 2+ dimensions."),
    ] = 0.0
    nesterov: Annotated[bool, Field(description="sgd: Nesterov momentum (needs momentum > 0).")] = False


class HierarchicalConfig(CamelModel):
    """Hierarchical SGD: allreduce inside a group every step, model averaging across groups."""

    group_by: Annotated[
        GroupBy, Field(description="Default grouping when the controller gives none: by node, or by measured speed.")
    ] = GroupBy.NODE
    groups: Annotated[
        list[list[Rank]] | None,
        Field(max_length=1024, description="Explicit groups of global ranks; every rank in exactly one group."),
    ] = None
    average_every: Annotated[int, Field(ge=1, le=10_000, description="Steps between cross-group model averages.")] = 4
    staleness: Annotated[
        int,
        Field(
            ge=0,
            le=64,
            description="How many averaging rounds a group may run ahead of the slowest group before it waits.",
        ),
    ] = 2

    @model_validator(mode="after")
    def _groups(self) -> Self:
        if self.groups is not None:
            seen: set[int] = set()
            for i, group in enumerate(self.groups):
                if not group:
                    raise cross_field_error(f"groups[{i}]", "a group must list at least one rank")
                for rank in group:
                    if rank < 0 or rank in seen:
                        raise cross_field_error(f"groups[{i}]", f"rank {rank} is negative or in two groups")
                    seen.add(rank)
        return self


class AsyncConfig(CamelModel):
    """Asynchronous SGD through sharded parameter servers with bounded gradient staleness."""

    staleness: Annotated[
        int | None,
        Field(
            ge=0,
            le=100_000,
            description=(
                "Oldest gradient applied, in steps others took since its pull; staler ones are dropped. "
                "Omit: unbounded (ASP)."
            ),
        ),
    ] = 8
    staleness_lr: Annotated[
        StalenessLr,
        Field(
            description=(
                "Learning-rate damping by a gradient's staleness s: none, inverse (1/(1+s)) or sqrt (1/sqrt(1+s))."
            )
        ),
    ] = StalenessLr.SQRT
    shards: Annotated[
        int, Field(ge=1, le=64, description="Parameter-server shards; each holds a slice of the parameters.")
    ] = 1


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


class TrainingConfig(CamelModel):
    """What to train and how; read by every trainer process."""

    task: Annotated[
        str | None,
        Field(
            max_length=256,
            pattern=HOOK_PATTERN,
            description=(
                "A 'module:function' returning an sgdjob_trainer.task.Task (model, data, loss, optionally "
                "optimizer, schedule and metric); replaces model, dataset and loss."
            ),
        ),
    ] = None

    model: Annotated[
        str,
        Field(
            max_length=256,
            description="Built-in model (mlp, digits-mlp, digits-cnn) or a 'module:function' returning an nn.Module.",
        ),
    ] = "mlp"
    dataset: Annotated[
        str,
        Field(
            max_length=256,
            description="Built-in dataset (synthetic, digits) or a 'module:function' returning a map-style Dataset.",
        ),
    ] = "synthetic"
    loss: Annotated[
        str,
        Field(max_length=256, description="Loss: auto (from the dataset), mse, cross-entropy, or a 'module:function'."),
    ] = "auto"
    batch_size: Annotated[int, Field(ge=1, le=65_536, description="Samples per step per worker process.")] = 32
    learning_rate: Annotated[
        float,
        Field(gt=0.0, le=10.0, description="Learning rate at the reference world size (minReplicas x nprocPerNode)."),
    ] = 0.05
    momentum: Annotated[float, Field(ge=0.0, le=0.999, description="SGD momentum.")] = 0.0
    optimizer: Annotated[
        OptimizerConfig, Field(description="The optimizer: sgd, adam or adamw and their parameters.")
    ] = OptimizerConfig()
    lr_scaling: Annotated[
        LrScaling, Field(description="How the learning rate follows a world-size change: linear, sqrt or none.")
    ] = LrScaling.LINEAR
    steps: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000_000,
            description="Total optimizer steps (of the fastest worker in async mode) before the job ends.",
        ),
    ] = 1000
    seed: Annotated[int, Field(ge=0, le=2**31 - 1, description="Seed for model initialisation and data order.")] = 0
    metrics_port: Annotated[
        int,
        Field(
            ge=1024,
            le=65_535,
            description="Port of each worker's /metrics, /status and /control server (plus the local rank).",
        ),
    ] = 9400
    checkpoint: Annotated[Checkpoint, Field(description="Checkpoint location and interval.")] = Checkpoint()
    lr_policy: Annotated[LrPolicy, Field(description="Learning-rate warmup and schedule.")] = LrPolicy()
    gradient_accumulation_steps: Annotated[
        int,
        Field(
            ge=1,
            le=1024,
            description=(
                "Micro-batches of batchSize accumulated per optimizer step (samples per step = batchSize x this)."
            ),
        ),
    ] = 1
    precision: Annotated[
        Precision,
        Field(description="Autocast precision of forward/backward: fp32, bf16, or fp16 (with dynamic loss scaling)."),
    ] = Precision.FP32
    compression: Annotated[
        Compression,
        Field(
            description=(
                "Gradient compression of the synchronous allreduce "
                "(sync mode and inside hierarchical groups): none or bf16."
            )
        ),
    ] = Compression.NONE
    hierarchical: Annotated[
        HierarchicalConfig, Field(description="Settings used while the job runs hierarchical SGD.")
    ] = HierarchicalConfig()
    async_: Annotated[
        AsyncConfig, Field(alias="async", description="Settings used while the job runs asynchronous SGD.")
    ] = AsyncConfig()
    emulation: Annotated[
        Emulation | None,
        Field(description="Emulated compute speed per rank, for CPU-only tests and benchmarks. Off when omitted."),
    ] = None
    faults: Annotated[
        list[Fault],
        Field(
            max_length=64,
            description=(
                "Emulated crashes (a rank exits abruptly), for tests and benchmarks of recovery. None unless given."
            ),
        ),
    ] = []

    evaluation: Annotated[
        Evaluation,
        Field(description="Validation on a held-out split: how often (rank 0, between steps) and on how many samples."),
    ] = Evaluation()
    target: Annotated[
        Target | None,
        Field(description="End the job successfully once rank 0's validation reaches this. None unless given."),
    ] = None

    @model_validator(mode="after")
    def _names(self) -> Self:
        if self.task is not None:
            # By value, not by what was set: a run-config file carries every field written out.
            for name in ("model", "dataset", "loss"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise cross_field_error(name, f"training.task provides the {name}; remove training.{name}")
        if self.momentum > 0 and self.optimizer.name != OptimizerName.SGD:
            raise cross_field_error(
                "momentum", f"momentum is SGD's; {self.optimizer.name.value} uses optimizer.betas instead"
            )
        if self.optimizer.nesterov and (self.optimizer.name != OptimizerName.SGD or self.momentum == 0):
            raise cross_field_error("optimizer.nesterov", "Nesterov momentum needs optimizer.name sgd and momentum > 0")
        _hook_or_builtin(self.model, BUILTIN_MODELS, "model")
        _hook_or_builtin(self.dataset, BUILTIN_DATASETS, "dataset")
        _hook_or_builtin(self.loss, BUILTIN_LOSSES, "loss")
        if self.target is not None:
            regression = self.task is None and (
                self.loss == "mse" or (self.loss == "auto" and self.dataset == "synthetic")
            )
            if self.target.metric == TargetMetric.ACCURACY and regression:
                raise cross_field_error(
                    "target.metric", "an accuracy target needs a classification (cross-entropy) loss"
                )
            if self.target.metric == TargetMetric.METRIC and self.evaluation.metric is None:
                raise cross_field_error(
                    "target.metric", "a metric target needs evaluation.metric, the 'module:function' that computes it"
                )
            if self.evaluation.every_steps is None and self.evaluation.every_seconds is None:
                raise cross_field_error(
                    "evaluation.everySteps", "a target needs periodic validation: give everySteps or everySeconds"
                )
        return self

    def check_world(self, world_size: int) -> None:
        """Raise when a rank-indexed setting names a rank outside a world of `world_size`."""
        if self.emulation is not None:
            for i, change in enumerate(self.emulation.slowdowns):
                if change.rank is not None and change.rank >= world_size:
                    raise cross_field_error(
                        f"emulation.slowdowns[{i}].rank",
                        f"rank {change.rank} does not exist in a world of at most {world_size} processes",
                    )
        for i, fault in enumerate(self.faults):
            if fault.rank >= world_size:
                raise cross_field_error(
                    f"faults[{i}].rank",
                    f"rank {fault.rank} does not exist in a world of at most {world_size} processes",
                )
        if self.hierarchical.groups is not None:
            for i, group in enumerate(self.hierarchical.groups):
                for rank in group:
                    if rank >= world_size:
                        raise cross_field_error(
                            f"hierarchical.groups[{i}]",
                            f"rank {rank} does not exist in a world of at most {world_size} processes",
                        )


def load_training_config(data: dict[str, Any]) -> TrainingConfig:
    """Parse a mapping (camelCase keys, as in the SGDJob's spec.training) into a TrainingConfig."""
    return TrainingConfig.model_validate(data)
