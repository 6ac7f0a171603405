"""The SGDJob API (group sgdjob.dev, version v1alpha1) as pydantic models: the one source of truth.

The CRD schema is generated from these models (see `crd.py`); the operator and the CLI validate
with them, so a rule is written once. Rules the CRD schema cannot express on Kubernetes 1.20
(cross-field ones) live in the model validators and name the field they are about.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from sgdjob_operator.api.job_status import (
    LOSS_BOUND,
    MAX_DECISIONS,
    MAX_WORKERS,
    Condition,
    ControllerState,
    DecisionRecord,
    ExcludedNode,
    Phase,
    SGDJobStatus,
    StoreMove,
    StoreSilence,
    Straggler,
)
from sgdjob_operator.api.scheduling import SchedulingPolicy, check_against_spec
from sgdjob_trainer.config import CamelModel, SyncMode, TrainingConfig, cross_field_error

GROUP = "sgdjob.dev"
VERSION = "v1alpha1"
KIND = "SGDJob"
PLURAL = "sgdjobs"
SINGULAR = "sgdjob"
SHORT_NAMES = ["sgdj"]
API_VERSION = f"{GROUP}/{VERSION}"


# The status models live in `job_status`; callers import every API name from here.
__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "LOSS_BOUND",
    "MAX_DECISIONS",
    "MAX_WORKERS",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "Action",
    "CleanPodPolicy",
    "Condition",
    "ControllerState",
    "DecisionRecord",
    "ExcludedNode",
    "JobMode",
    "Phase",
    "PolicySpec",
    "RunPolicy",
    "SGDJob",
    "SGDJobSpec",
    "SGDJobStatus",
    "StoreMove",
    "StoreSilence",
    "Straggler",
]


class JobMode(StrEnum):
    """Requested synchronisation: a fixed mode, or `auto` to let the policy choose at run time."""

    AUTO = "auto"
    SYNC = "sync"
    HIERARCHICAL = "hierarchical"
    ASYNC = "async"


class Action(StrEnum):
    """What the policy may do to a running job."""

    SWITCH_MODE = "switchMode"
    REBALANCE = "rebalance"
    REPLACE_WORKER = "replaceWorker"
    RESCALE = "rescale"
    TRIM_BATCH = "trimBatch"


class CleanPodPolicy(StrEnum):
    NONE = "None"
    RUNNING = "Running"
    ALL = "All"


class PolicySpec(CamelModel):
    """How the controller watches worker speed and when it adapts the job."""

    interval_seconds: Annotated[
        float,
        Field(ge=0.5, le=3600.0, description="Seconds between two policy evaluations (one scrape of every worker)."),
    ] = 10.0
    straggler_threshold: Annotated[
        float,
        Field(
            ge=1.05, le=100.0, description="A rank is a straggler when its step time exceeds the median by this factor."
        ),
    ] = 1.5
    recover_threshold: Annotated[
        float,
        Field(
            ge=1.0,
            le=100.0,
            description=(
                "A straggler recovers when its ratio falls below this factor (hysteresis; below stragglerThreshold)."
            ),
        ),
    ] = 1.2
    persistence_intervals: Annotated[
        int, Field(ge=1, le=100, description="Intervals a condition must persist before the policy acts on it.")
    ] = 3
    cooldown_seconds: Annotated[
        float,
        Field(
            ge=0.0,
            le=86_400.0,
            description=(
                "Least seconds between two changes to the job. Not waited for by the way back to plain "
                "sync, nor by a new split of sync's batch (no pause); every change starts it, except that a "
                "restart (rescale, replacement) waits it out only after a change that paused training."
            ),
        ),
    ] = 60.0
    switch_margin: Annotated[
        float,
        Field(
            ge=0.0,
            le=10.0,
            description=(
                "Least predicted relative throughput gain (0.1 = 10%) that justifies a change. A new split "
                "of sync's batch needs at most 3% once every rank's speed rests on 10 steps at its batch."
            ),
        ),
    ] = 0.1
    staleness_penalty: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description=(
                "Statistical efficiency lost per step of staleness, assumed by the cost model until the "
                "workers have measured their gradients (then the measured gradient correlation is used)."
            ),
        ),
    ] = 0.02
    hang_timeout_seconds: Annotated[
        float | None,
        Field(
            ge=5.0,
            le=86_400.0,
            description=(
                "A rank that has finished no step for this long while stuck in its own compute (or a job where no "
                "rank moves) is hung: its worker is replaced, and the job resumes from the last checkpoint. "
                "Omit to never treat a rank as hung. Longer than the slowest legitimate step (checkpoint, validation)."
            ),
        ),
    ] = 300.0
    exclude_node_seconds: Annotated[
        float,
        Field(
            ge=0.0,
            le=2_592_000.0,
            description=(
                "Seconds a node stays excluded after the policy took a worker off it because the node was slow "
                "(a replacement, or a rescale that removed it). Expired exclusions are dropped and the job may use "
                "the node again. 0 keeps nodes excluded for the job's lifetime."
            ),
        ),
    ] = 3600.0
    allowed_actions: Annotated[
        list[Action],
        Field(
            max_length=5,
            description=(
                "Actions the policy may take: switchMode, rebalance, replaceWorker, rescale, trimBatch. trimBatch (not "
                "in the default) lets a straggler's step shrink the global batch under linear lrScaling where the "
                "measured gradient noise scale says a smaller batch is worth more per sample; on the goodput "
                "benchmark it trained no sooner than the rebalanced split (bench/HISTORY.md)."
            ),
        ),
    ] = [
        Action.SWITCH_MODE,
        Action.REBALANCE,
        Action.REPLACE_WORKER,
    ]

    @model_validator(mode="after")
    def _thresholds(self) -> Self:
        if self.recover_threshold >= self.straggler_threshold:
            raise cross_field_error(
                "recoverThreshold",
                f"recoverThreshold ({self.recover_threshold}) must be below "
                f"stragglerThreshold ({self.straggler_threshold}) so a straggler cannot flap",
            )
        if len(set(self.allowed_actions)) != len(self.allowed_actions):
            raise cross_field_error("allowedActions", "list each action at most once")
        return self


class RunPolicy(CamelModel):
    """Job lifecycle, as in Kubeflow's RunPolicy."""

    backoff_limit: Annotated[
        int,
        Field(
            ge=0,
            le=1000,
            description=(
                "Worker failures allowed before the job is marked Failed; a pod evicted, preempted, lost with "
                "its node or deleted while it ran does not count."
            ),
        ),
    ] = 3
    active_deadline_seconds: Annotated[
        int | None, Field(ge=1, le=31_536_000, description="Seconds the job may run before it is marked Failed.")
    ] = None
    ttl_seconds_after_finished: Annotated[
        int | None,
        Field(ge=0, le=31_536_000, description="Seconds after the job finishes before it is deleted; omit to keep it."),
    ] = None
    clean_pod_policy: Annotated[
        CleanPodPolicy, Field(description="Which pods to delete when the job finishes: None, Running or All.")
    ] = CleanPodPolicy.RUNNING
    suspend: Annotated[
        bool,
        Field(
            description=(
                "When true, worker pods are removed and the job waits; checkpoints are kept. Set back to false, "
                "the job resumes from its newest checkpoint once every pod of the suspension has ended."
            )
        ),
    ] = False
    node_lost_grace_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=3600,
            description=(
                "Seconds a node may stay NotReady or Unknown (its kubelet stopped reporting) before the job's pods "
                "there are force-deleted and recreated on other nodes; well under the 300 s after which Kubernetes "
                "evicts them."
            ),
        ),
    ] = 40
    store_lost_grace_seconds: Annotated[
        int,
        Field(
            ge=5,
            le=3600,
            description=(
                "Seconds the rendezvous store's pod may fail the operator's health check (GET /healthz, a round trip "
                "through the store) while the job makes no progress before it is re-homed on another node (the "
                "workers then rendezvous again from the last checkpoint). Applies to a store that answered before."
            ),
        ),
    ] = 10
    scheduling_policy: Annotated[
        SchedulingPolicy | None, Field(description="Gang scheduling of the worker pods (Volcano or coscheduling).")
    ] = None


POD_TEMPLATE_DESCRIPTION = (
    "Worker PodTemplateSpec (image, resources incl. nvidia.com/gpu, nodeSelector, tolerations, volumes). "
    "The operator merges its command, env and ports into the first container."
)


class SGDJobSpec(CamelModel):
    """Desired state of an SGDJob."""

    replicas: Annotated[
        int, Field(ge=1, le=MAX_WORKERS, description="Worker pods (nodes) to run now; `kubectl scale` changes it.")
    ] = 1
    min_replicas: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_WORKERS,
            description="Fewest worker pods training may go on with (torchrun --nnodes min). Defaults to replicas.",
        ),
    ] = None
    max_replicas: Annotated[
        int | None,
        Field(ge=1, le=MAX_WORKERS, description="Most worker pods (torchrun --nnodes max). Defaults to replicas."),
    ] = None
    nproc_per_node: Annotated[
        int, Field(ge=1, le=64, description="Trainer processes per worker pod, usually its GPU count.")
    ] = 1
    mode: Annotated[
        JobMode, Field(description="Synchronisation: sync, hierarchical, async, or auto to switch at run time.")
    ] = JobMode.AUTO
    training: Annotated[TrainingConfig, Field(description="What each trainer process trains and how.")] = (
        TrainingConfig()
    )
    policy: Annotated[PolicySpec, Field(description="When and how the controller adapts the job.")] = PolicySpec()
    template: Annotated[
        dict[str, Any],
        Field(description=POD_TEMPLATE_DESCRIPTION, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
    ] = {}
    run_policy: Annotated[RunPolicy, Field(description="Restarts, deadline, clean-up and suspension.")] = RunPolicy()

    @property
    def min_workers(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def max_workers(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    @property
    def max_world_size(self) -> int:
        return self.max_workers * self.nproc_per_node

    @model_validator(mode="after")
    def _cross_fields(self) -> Self:
        if self.min_workers > self.replicas:
            raise cross_field_error(
                "minReplicas",
                f"minReplicas ({self.min_workers}) must be <= replicas ({self.replicas}): "
                "lower minReplicas or raise replicas",
            )
        if self.max_workers < self.replicas:
            raise cross_field_error(
                "maxReplicas",
                f"maxReplicas ({self.max_workers}) must be >= replicas ({self.replicas}): "
                "raise maxReplicas or lower replicas",
            )
        if Action.RESCALE in self.policy.allowed_actions and self.min_workers == self.max_workers:
            raise cross_field_error(
                "policy.allowedActions",
                "rescale is allowed but minReplicas == maxReplicas: widen the bounds or drop rescale",
            )
        if self.training.on_adaptation_api and self.mode == JobMode.HIERARCHICAL:
            # Its groups come from speeds measured in sync; async needs no such measurement.
            raise cross_field_error(
                "mode",
                "a script on the adaptation API (training.adaptation: api) starts in sync or async, not "
                "hierarchical: set mode to auto to let the policy switch it to hierarchical once it has "
                "measured the ranks' speeds, or to sync or async",
            )
        emulation = self.training.emulation
        if emulation is not None and emulation.cpu_limits is not None and len(emulation.cpu_limits) != self.replicas:
            raise cross_field_error(
                "training.emulation.cpuLimits",
                f"gives {len(emulation.cpu_limits)} CPU limits for {self.replicas} replicas: "
                "give one limit (in CPUs) per worker, local-0 first",
            )
        if self.run_policy.scheduling_policy is not None:
            check_against_spec(self.run_policy.scheduling_policy, self.template, self.max_workers)
        if (sizes := self.training.rank_batch_sizes) is not None:
            if self.mode is not JobMode.SYNC:
                raise cross_field_error(
                    "training.rankBatchSizes",
                    f"a static split is for mode sync, not {self.mode.value}: set mode: sync, or drop rankBatchSizes "
                    "(auto rebalances sync's batch itself from the measured speeds)",
                )
            if len(sizes) != self.replicas * self.nproc_per_node:
                raise cross_field_error(
                    "training.rankBatchSizes",
                    f"{len(sizes)} batch sizes for {self.replicas * self.nproc_per_node} processes "
                    "(replicas x nprocPerNode): give one per rank",
                )
        try:
            self.training.check_world(self.max_world_size)
        except PydanticCustomError as err:
            ctx = err.context or {}
            raise cross_field_error(f"training.{ctx.get('field', '')}", str(ctx.get("message", err.message()))) from err
        return self

    @property
    def initial_mode(self) -> SyncMode:
        """The mode workers start in: auto starts synchronous and lets the policy move it."""
        return SyncMode.SYNC if self.mode is JobMode.AUTO else SyncMode(self.mode.value)


class SGDJob(CamelModel):
    """An elastic PyTorch training job that adapts its synchronisation to its workers' speed."""

    model_config = CamelModel.model_config | {"extra": "ignore"}

    api_version: Annotated[str, Field(alias="apiVersion", description="sgdjob.dev/v1alpha1")] = API_VERSION
    kind: Annotated[str, Field(description="SGDJob")] = KIND
    metadata: Annotated[dict[str, Any], Field(description="Standard object metadata.")] = {}
    spec: Annotated[SGDJobSpec, Field(description="Desired state.")]
    status: Annotated[SGDJobStatus | None, Field(description="Observed state.")] = None

    @model_validator(mode="after")
    def _type(self) -> Self:
        if self.api_version != API_VERSION:
            raise cross_field_error("apiVersion", f"apiVersion must be {API_VERSION}, not '{self.api_version}'")
        if self.kind != KIND:
            raise cross_field_error("kind", f"kind must be {KIND}, not '{self.kind}'")
        return self
