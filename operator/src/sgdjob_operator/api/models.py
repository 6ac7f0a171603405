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

from sgdjob_operator.api.scheduling import SchedulingPolicy, check_against_spec
from sgdjob_trainer.config import CamelModel, SyncMode, TrainingConfig, cross_field_error

GROUP = "sgdjob.dev"
VERSION = "v1alpha1"
KIND = "SGDJob"
PLURAL = "sgdjobs"
SINGULAR = "sgdjob"
SHORT_NAMES = ["sgdj"]
API_VERSION = f"{GROUP}/{VERSION}"
MAX_WORKERS = 1024
MAX_DECISIONS = 20
LOSS_BOUND = 1e15


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


class CleanPodPolicy(StrEnum):
    NONE = "None"
    RUNNING = "Running"
    ALL = "All"


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    ADAPTING = "Adapting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


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
                "sync, nor by a new split of sync's batch (no pause); every change starts it."
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
                "of sync's batch needs at most 3% once every rank's speed rests on 20 steps at its batch."
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
        Field(max_length=4, description="Actions the policy may take: switchMode, rebalance, replaceWorker, rescale."),
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
        bool, Field(description="When true, worker pods are removed and the job waits; checkpoints are kept.")
    ] = False
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
        if self.run_policy.scheduling_policy is not None:
            check_against_spec(self.run_policy.scheduling_policy, self.template, self.max_workers)
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


class Condition(CamelModel):
    """A Kubernetes-style condition."""

    type: Annotated[
        str,
        Field(
            max_length=64,
            description="Condition type: Created, Running, Adapting, WorkerHung, Suspended, Succeeded, Failed.",
        ),
    ]
    status: Annotated[str, Field(max_length=16, description="True, False or Unknown.")]
    reason: Annotated[str, Field(max_length=128, description="One CamelCase word for machines.")] = ""
    message: Annotated[str, Field(max_length=4096, description="Human-readable detail.")] = ""
    last_transition_time: Annotated[
        str | None, Field(max_length=64, description="When the status last changed (RFC 3339).")
    ] = None


class DecisionRecord(CamelModel):
    """One decision of the policy, as kept in status."""

    time: Annotated[str, Field(max_length=64, description="When it was decided (RFC 3339).")]
    action: Annotated[str, Field(max_length=32, description="keep, switchMode, rebalance, replaceWorker or rescale.")]
    reason: Annotated[str, Field(max_length=4096, description="Why, in words.")]
    mode: Annotated[str | None, Field(max_length=32, description="Target mode of a switch.")] = None
    rank: Annotated[int | None, Field(ge=0, le=65_535, description="Rank a replacement is about.")] = None
    replicas: Annotated[int | None, Field(ge=0, le=MAX_WORKERS, description="Target replicas of a rescale.")] = None
    step: Annotated[int | None, Field(ge=0, le=10**12, description="Job step at the decision.")] = None
    pod: Annotated[str | None, Field(max_length=253, description="Worker pod a replacement is about.")] = None
    hung: Annotated[
        bool | None,
        Field(description="True when the replacement recovers from a hung worker (policy.hangTimeoutSeconds)."),
    ] = None


class Straggler(CamelModel):
    """A rank found persistently slower than the median."""

    rank: Annotated[int, Field(ge=0, le=65_535, description="Global rank.")]
    pod: Annotated[str | None, Field(max_length=253, description="Worker pod of the rank.")] = None
    node: Annotated[str | None, Field(max_length=253, description="Node of the rank.")] = None
    slowdown: Annotated[float, Field(ge=0.0, le=1e6, description="Step compute time relative to the median.")] = 1.0


_OPAQUE: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}


class ExcludedNode(CamelModel):
    """A node the job's workers are kept off, since when, until when, and why."""

    node: Annotated[str, Field(max_length=253, description="Node name.")]
    since: Annotated[str | None, Field(max_length=64, description="When it was excluded (RFC 3339).")] = None
    until: Annotated[
        str | None,
        Field(max_length=64, description="When the exclusion ends (RFC 3339); absent: never (excludeNodeSeconds 0)."),
    ] = None
    reason: Annotated[str, Field(max_length=512, description="Why the node was excluded.")] = ""

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        # Operators before excludeNodeSeconds stored plain node names.
        return {"node": value} if isinstance(value, str) else value


class ControllerState(CamelModel):
    """The operator's own bookkeeping, kept in status (never only in memory) so a restarted operator
    resumes where it stopped: the control command it wants applied, nodes it keeps the job off,
    failures already counted against backoffLimit, and the policy's opaque state."""

    command: Annotated[
        dict[str, Any] | None,
        Field(
            description="Latest control command (ControlCommand JSON), re-pushed until rank 0 reports its epoch.",
            json_schema_extra=_OPAQUE,
        ),
    ] = None
    excluded_nodes: Annotated[
        list[ExcludedNode],
        Field(
            max_length=256,
            description="Nodes this job's workers are kept off (slow nodes the policy took workers off), until when.",
        ),
    ] = []
    worker_indices: Annotated[
        list[Annotated[int, Field(ge=0, le=65_535)]] | None,
        Field(
            max_length=MAX_WORKERS,
            description=(
                "Worker pod indices the job runs when they are not 0..replicas-1 (the policy removed a pod from the "
                "middle); absent: 0..replicas-1."
            ),
        ),
    ] = None
    goal_replicas: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_WORKERS,
            description="spec.replicas as the user set it before the policy shrank the job: what it grows back to.",
        ),
    ] = None
    scaled_replicas: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_WORKERS,
            description="spec.replicas as the policy last set it (another value means a person scaled the job since).",
        ),
    ] = None
    counted_failures: Annotated[
        list[Annotated[str, Field(max_length=64)]],
        Field(max_length=256, description="UIDs of failed worker pods already counted in restarts."),
    ] = []
    policy_state: Annotated[
        str | None,
        Field(
            max_length=1_000_000,
            description=(
                "Deprecated: where older operators kept the policy core's state; read once and moved to the "
                "job's <name>-policy-state ConfigMap."
            ),
        ),
    ] = None
    last_change_time: Annotated[
        str | None, Field(max_length=64, description="When the operator last changed the job (RFC 3339).")
    ] = None


class SGDJobStatus(CamelModel):
    """Observed state of an SGDJob, written by the operator."""

    phase: Annotated[Phase, Field(description="Pending, Running, Adapting, Suspended, Succeeded or Failed.")] = (
        Phase.PENDING
    )
    mode: Annotated[str | None, Field(max_length=32, description="Mode the workers report now.")] = None
    target_mode: Annotated[
        str | None,
        Field(max_length=32, description="Mode the controller wants; differs from mode while a switch is in flight."),
    ] = None
    replicas: Annotated[int, Field(ge=0, le=MAX_WORKERS, description="Worker pods that exist.")] = 0
    ready_replicas: Annotated[int, Field(ge=0, le=MAX_WORKERS, description="Worker pods running and ready.")] = 0
    ready: Annotated[str, Field(max_length=16, description="ready/desired worker pods, for kubectl get.")] = "0/0"
    stragglers: Annotated[list[Straggler], Field(max_length=MAX_WORKERS, description="Ranks found slow now.")] = []
    straggler_count: Annotated[int, Field(ge=0, le=65_535, description="How many ranks are stragglers now.")] = 0
    step: Annotated[int, Field(ge=0, le=10**12, description="Latest optimizer step reported by the workers.")] = 0
    # Bounds stay inside int64: the API server compares an integral value (a loss of exactly 0) against
    # the bound as an int64, and a larger bound overflows into a rule no value can meet.
    loss: Annotated[
        float | None, Field(ge=-LOSS_BOUND, le=LOSS_BOUND, description="Latest training loss (clamped to +-1e15).")
    ] = None
    throughput: Annotated[
        float | None, Field(ge=0.0, le=1e12, description="Samples per second over the last interval.")
    ] = None
    validation_loss: Annotated[
        float | None,
        Field(ge=-LOSS_BOUND, le=LOSS_BOUND, description="Rank 0's latest loss on the held-out split (clamped)."),
    ] = None
    validation_accuracy: Annotated[
        float | None,
        Field(ge=0.0, le=1.0, description="Rank 0's latest accuracy on the held-out split (classification)."),
    ] = None
    validation_metric: Annotated[
        float | None,
        Field(
            ge=-LOSS_BOUND,
            le=LOSS_BOUND,
            description="Rank 0's latest spec.training.evaluation.metric on the held-out split (clamped).",
        ),
    ] = None
    target_step: Annotated[
        int | None,
        Field(ge=0, le=10**12, description="Step at which the validation reached spec.training.target."),
    ] = None
    time_to_target_seconds: Annotated[
        float | None,
        Field(ge=0.0, le=1e9, description="Seconds of training until the validation reached spec.training.target."),
    ] = None
    restarts: Annotated[int, Field(ge=0, le=10**6, description="Worker restarts so far.")] = 0
    conditions: Annotated[list[Condition], Field(max_length=16, description="Kubernetes-style conditions.")] = []
    decisions: Annotated[
        list[DecisionRecord], Field(max_length=MAX_DECISIONS, description="Most recent policy decisions, oldest first.")
    ] = []
    observed_generation: Annotated[int, Field(ge=0, le=2**62, description="metadata.generation last acted on.")] = 0
    start_time: Annotated[str | None, Field(max_length=64, description="When the workers started (RFC 3339).")] = None
    completion_time: Annotated[str | None, Field(max_length=64, description="When the job finished (RFC 3339).")] = None
    message: Annotated[str, Field(max_length=4096, description="Latest human-readable summary.")] = ""
    controller: Annotated[ControllerState | None, Field(description="Operator bookkeeping; not for users.")] = None


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
