"""The trainer's configuration: `spec.training` of an SGDJob (the file the trainer reads around it is
`sgdjob_trainer.wire.launch.RunConfig`).

This module must stay free of torch: the operator imports it to generate the CRD schema and to
validate specs, and the operator image carries no torch.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import Field, model_validator

from sgdjob_trainer.config_base import (
    HOOK_PATTERN,
    CamelModel,
    Compression,
    GroupBy,
    LrScaling,
    LrSchedule,
    Precision,
    Rank,
    StalenessLr,
    SyncMode,
    cross_field_error,
)
from sgdjob_trainer.config_emulation import Bursts, Emulation, Fault, FaultKind, SpeedChange
from sgdjob_trainer.config_evaluation import Evaluation, Target, TargetMetric

# The shared pieces and the emulation models live in their own modules; callers import every
# configuration name from here.
__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_LOSSES",
    "BUILTIN_MODELS",
    "HOOK_PATTERN",
    "Adaptation",
    "AsyncConfig",
    "Bursts",
    "CamelModel",
    "Checkpoint",
    "Compression",
    "Emulation",
    "Evaluation",
    "Fault",
    "FaultKind",
    "GroupBy",
    "HierarchicalConfig",
    "LrPolicy",
    "LrScaling",
    "LrSchedule",
    "OptimizerConfig",
    "OptimizerName",
    "Precision",
    "Rank",
    "SpeedChange",
    "StalenessLr",
    "SyncMode",
    "Target",
    "TargetMetric",
    "TrainingConfig",
    "cross_field_error",
    "load_training_config",
]

BUILTIN_MODELS = ("mlp", "digits-mlp", "digits-cnn")
BUILTIN_DATASETS = ("synthetic", "digits")
BUILTIN_LOSSES = ("auto", "mse", "cross-entropy")


def _hook_or_builtin(value: str, builtins: tuple[str, ...], field: str) -> str:
    if value in builtins or re.match(HOOK_PATTERN, value):
        return value
    raise cross_field_error(
        field, f"'{value}' is neither a built-in ({', '.join(builtins)}) nor a 'module:function' hook"
    )


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
    momentum: Annotated[
        float | None,
        Field(
            ge=0.0,
            le=0.999,
            description=(
                "SGD momentum the parameter servers apply in async. Omit: the job's momentum lowered for the "
                "momentum asynchrony adds by itself (max(0, 1 - workers x (1 - momentum))); set the job's own "
                "value to keep it."
            ),
        ),
    ] = None


class Adaptation(StrEnum):
    """How a command-mode script cooperates with SGDJob."""

    NONE = "none"
    API = "api"


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

    command: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4096)]] | None,
        Field(
            min_length=1,
            max_length=256,
            description=(
                "Command mode: the argv of your own torchrun script, run unmodified under the job's torchrun "
                "agents (e.g. [python, train.py, --epochs, '3']); it reads RANK, WORLD_SIZE, LOCAL_RANK, "
                "MASTER_ADDR/PORT from the environment. Mode switches and rebalancing are off (the script does "
                "not report to SGDJob) unless `adaptation` is api. Environment and working directory come from the "
                "pod template's container; `sgdjob run` runs it in the job file's folder. Excludes task."
            ),
        ),
    ] = None
    adaptation: Annotated[
        Adaptation,
        Field(
            description=(
                "With command: `api` when the script uses SGDJob's adaptation API (sgdjob_trainer.adapt): it "
                "reports its steps and follows the per-rank batch split, agreed stops and checkpoints, so the "
                "policy may rebalance it, and switch it among sync, hierarchical and async where the script gives "
                "adapt.start its optimizer (async: and reads its data through session.loader); batchSize is its "
                "per-rank batch. "
                "`none` (the default) runs it as written."
            )
        ),
    ] = Adaptation.NONE

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
    rank_batch_sizes: Annotated[
        list[Annotated[int, Field(ge=1, le=65_536)]] | None,
        Field(
            max_length=65_536,
            description=(
                "A static split of sync's step from step 0 (LB-BSP): one batch size per rank, for a fleet whose "
                "speeds you know; the global batch is their sum. mode sync only, one entry per process "
                "(replicas x nprocPerNode); a world of another size uses batchSize. Auto finds the split itself."
            ),
        ),
    ] = None
    learning_rate: Annotated[
        float,
        Field(gt=0.0, le=10.0, description="Learning rate at the reference world size (minReplicas x nprocPerNode)."),
    ] = 0.05
    momentum: Annotated[float, Field(ge=0.0, le=0.999, description="SGD momentum.")] = 0.0
    optimizer: Annotated[
        OptimizerConfig, Field(description="The optimizer: sgd, adam or adamw and their parameters.")
    ] = OptimizerConfig()
    lr_scaling: Annotated[
        LrScaling,
        Field(
            description=(
                "How the learning rate follows a change of the global batch (a resized world, or auto's trimmed "
                "split of sync's batch): linear, sqrt or none. Only under linear may auto trim the global batch."
            )
        ),
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
        if self.command is not None:
            self._command_only()
        elif self.adaptation != Adaptation.NONE:
            raise cross_field_error(
                "adaptation",
                "training.adaptation is for a training.command script; SGDJob's own trainer adapts without it",
            )
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

    @property
    def reports(self) -> bool:
        """Whether the workers report to SGDJob and follow its commands: the trainer, or a command-mode
        script on the adaptation API."""
        return self.command is None or self.adaptation == Adaptation.API

    @property
    def on_adaptation_api(self) -> bool:
        return self.command is not None and self.adaptation == Adaptation.API

    def _command_only(self) -> None:
        """Command mode runs the user's script, not the trainer: what only the trainer does is refused."""
        if self.task is not None:
            raise cross_field_error(
                "command", "training.command and training.task are mutually exclusive: remove one of them"
            )
        for name in ("emulation", "target"):
            if getattr(self, name) is not None:
                raise cross_field_error(
                    name, f"training.{name} needs the SGDJob trainer; remove it or training.command"
                )
        if self.faults:
            raise cross_field_error("faults", "training.faults needs the SGDJob trainer; remove it or training.command")

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


def initial_batches(training: TrainingConfig, world_size: int) -> dict[int, int]:
    """Per-rank batch sizes a fresh world starts with: training.rankBatchSizes when it has one entry
    per rank of this world, else none (every rank takes batchSize)."""
    sizes = training.rank_batch_sizes
    if sizes is None or len(sizes) != world_size:
        return {}
    return dict(enumerate(sizes))


def load_training_config(data: dict[str, Any]) -> TrainingConfig:
    """Parse a mapping (camelCase keys, as in the SGDJob's spec.training) into a TrainingConfig."""
    return TrainingConfig.model_validate(data)
