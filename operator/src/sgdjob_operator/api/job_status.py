"""The SGDJob's status as pydantic models: phase, conditions, decisions, stragglers and the
operator's own bookkeeping. Part of the one source of the CRD; `models` re-exports every name here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, model_validator

from sgdjob_trainer.config import CamelModel

MAX_WORKERS = 1024
MAX_DECISIONS = 20
LOSS_BOUND = 1e15


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    ADAPTING = "Adapting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


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
    lost: Annotated[
        bool,
        Field(
            description=(
                "Excluded because the node was lost (not Ready for runPolicy.nodeLostGraceSeconds): the "
                "exclusion ends as soon as the node is Ready again, and the job grows back onto it."
            )
        ),
    ] = False

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        # Operators before excludeNodeSeconds stored plain node names.
        return {"node": value} if isinstance(value, str) else value


class StoreSilence(CamelModel):
    """The rendezvous store's pod as the operator last failed to reach it."""

    pod_uid: Annotated[str, Field(max_length=64, description="UID of the store's pod that did not answer.")]
    since: Annotated[str, Field(max_length=64, description="First failed connection (RFC 3339).")]
    step: Annotated[int, Field(ge=0, le=10**12, description="Job step when it first did not answer.")] = 0


class StoreMove(CamelModel):
    """The latest time the operator replaced the rendezvous store's pod under running workers."""

    time: Annotated[str, Field(max_length=64, description="When the old pod was deleted (RFC 3339).")]
    node: Annotated[str | None, Field(max_length=253, description="Node the old pod was on.")] = None
    reason: Annotated[str, Field(max_length=512, description="Why it was replaced.")] = ""
    step: Annotated[int, Field(ge=0, le=10**12, description="Job step when it was replaced.")] = 0


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
    growth_held_until: Annotated[
        str | None,
        Field(
            max_length=64,
            description=(
                "Until when (RFC 3339) the policy does not grow the job back: a growth whose pods the scheduler "
                "could not place was given back. Ends earlier when an exclusion ends or a lost node returns."
            ),
        ),
    ] = None
    progress: Annotated[
        list[Annotated[list[float], Field(min_length=2, max_length=2)]],
        Field(max_length=16, description="Recent [time, step] points, for the ETA's pace (policy.eta)."),
    ] = []
    validations: Annotated[
        list[Annotated[list[float], Field(min_length=2, max_length=2)]],
        Field(max_length=16, description="Rank 0's recent [step, value] validations of the target's metric (ETA)."),
    ] = []
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
    restart_seconds: Annotated[
        float | None,
        Field(
            ge=0.0,
            le=86_400.0,
            description=(
                "Seconds the job's latest start took, measured: from its creation, or from the policy's latest "
                "membership change, until every rank trained. The policy weighs a replacement or rescale by it "
                "(60 until measured)."
            ),
        ),
    ] = None
    restart_from: Annotated[
        str | None,
        Field(max_length=64, description="When the policy's latest membership change began, until its world trains."),
    ] = None
    shrink_seconds: Annotated[
        float | None,
        Field(
            ge=0.0,
            le=86_400.0,
            description=(
                "Seconds the policy's latest shrink took, measured from the change until every rank of the smaller "
                "world trained. A shrink starts no pod, so the policy weighs a rescale down by it, not restartSeconds "
                "(until measured: the lesser of restartSeconds and 10)."
            ),
        ),
    ] = None
    restart_shrinks: Annotated[
        bool | None,
        Field(description="Whether the membership change being measured (restartFrom) is a shrink."),
    ] = None
    checkpoint_failures: Annotated[
        int, Field(ge=0, le=10**9, description="Rank 0's failed checkpoint writes already reported in an Event.")
    ] = 0
    store_answered: Annotated[
        str | None,
        Field(max_length=64, description="UID of the latest rendezvous store pod that answered the operator."),
    ] = None
    store_silence: Annotated[
        StoreSilence | None, Field(description="The store's pod not answering the operator: since when.")
    ] = None
    store_move: Annotated[
        StoreMove | None, Field(description="The latest replacement of the store's pod under running workers.")
    ] = None


class SGDJobStatus(CamelModel):
    """Observed state of an SGDJob, written by the operator."""

    phase: Annotated[Phase, Field(description="Pending, Running, Adapting, Suspended, Succeeded or Failed.")] = (
        Phase.PENDING
    )
    mode: Annotated[str | None, Field(max_length=32, description="Mode the workers report now.")] = None
    mode_summary: Annotated[
        str | None,
        Field(
            max_length=64,
            description="The mode as kubectl get shows it: 'sync (rebalanced)' while the ranks' batch sizes differ.",
        ),
    ] = None
    batches: Annotated[
        str | None,
        Field(
            max_length=128,
            description=(
                "Per-rank batch sizes in rank order ('40/40/16') while they differ; a range for more than 16 ranks."
            ),
        ),
    ] = None
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
    eta: Annotated[
        str | None,
        Field(max_length=32, description="Predicted time left, to spec.training.target or the last step (etaBasis)."),
    ] = None
    eta_seconds: Annotated[float | None, Field(ge=0.0, le=1e9, description="eta in seconds.")] = None
    eta_basis: Annotated[
        str | None, Field(max_length=16, description="What eta counts to: 'target' or 'last step'.")
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
