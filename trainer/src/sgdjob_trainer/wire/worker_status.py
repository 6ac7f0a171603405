"""The document a trainer process serves on GET /status (and starts its rank report with).

The trainer builds a `WorkerStatus` and serves `document()`; controllers parse the JSON back into a
`WorkerStatus`. Parsing is lenient where the trainer's output may vary between versions: only `rank`
is required, a missing field reads as its default, and keys this version does not know are
ignored (a newer trainer under an older controller). Keys the trainer omits stay omitted when the
model is written back, so a document survives a parse unchanged.
"""

from __future__ import annotations

import statistics
from typing import Any

from pydantic import ConfigDict

from sgdjob_trainer.config import CamelModel, SyncMode


class WireDocument(CamelModel):
    """camelCase like the API models, but tolerant of keys added by a newer trainer."""

    model_config = ConfigDict(extra="ignore")

    def document(self) -> dict[str, Any]:
        """The JSON object as served: camelCase keys, only the fields that were given."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class SwitchRecord(WireDocument):
    """One mode switch this process took part in."""

    from_mode: SyncMode
    to_mode: SyncMode
    step: int
    pause_s: float
    reason: str = ""
    time_s: float = 0.0  # seconds since the process started


class ResumeRecord(WireDocument):
    """One restart of the job resumed from a checkpoint (rank 0 keeps the job's history)."""

    from_step: int
    reached_step: int
    lost_steps: int
    restart_seconds: float
    world_size: int
    restart_count: int


class Figures(WireDocument):
    """count, and when there is at least one value, their mean, max and total."""

    count: int = 0
    mean: float | None = None
    max: float | None = None
    total: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Figures:
        if not values:
            return cls(count=0)
        return cls(count=len(values), mean=statistics.fmean(values), max=max(values), total=sum(values))


class CheckpointReport(WireDocument):
    """How checkpoints went on this process: stalls of training and background write seconds."""

    stall_seconds: Figures
    write_seconds: Figures
    completed: list[int] = []
    # Writes that failed (a full or read-only volume): training goes on from the last good checkpoint.
    failed: int = 0
    last_error: str | None = None
    last_error_step: int | None = None


class WorkerStatus(WireDocument):
    """One trainer process now. Counters are cumulative since the process started; `step` is the
    job's step (in async, the parameter server's), unlike the metrics' own-steps counter."""

    rank: int
    local_rank: int = 0
    world_size: int = 0
    node: str | None = None
    mode: SyncMode | None = None
    step: int = 0
    # This process's own optimizer steps (the metrics' sgdjob_steps_total), and seconds since its training
    # began (absent before): with them one GET /status gives a controller the whole sample, /metrics not
    # needed. None: a trainer older than the fields.
    own_steps: int | None = None
    training_seconds: float | None = None
    samples: int = 0
    compute_seconds: float = 0.0
    comm_wait_seconds: float = 0.0
    loss: float | None = None  # null while no finite loss is known
    staleness: float = 0.0
    batch_size: int = 0
    control_epoch: int = 0
    # What this process could not carry out of the command of `control_epoch`, and why (absent when it
    # applied all of it). The epoch still counts as applied: a controller must not re-send it.
    control_error: str | None = None
    gradient_bytes: int = 0
    # Hang signals (see metric_names.STALLED_SECONDS): absent before training began.
    stalled_seconds: float | None = None
    computing: bool = False
    async_capable: bool = True  # see metric_names.ASYNC_CAPABLE
    hierarchical_capable: bool = True  # see metric_names.HIERARCHICAL_CAPABLE
    adaptive_optimizer: bool = False  # see metric_names.ADAPTIVE
    # Moving averages over the steps of the current mode (sgdjob_trainer.gradient_stats); absent until known.
    gradient_stat_steps: int = 0
    gradient_sq_norm: float | None = None
    gradient_variance: float | None = None
    gradient_lag_dot: float | None = None
    switches: list[SwitchRecord] = []
    done: bool = False
    time: float = 0.0  # the process's clock when it answered (seconds since the epoch)
    start_time: float = 0.0
    # Present once recovery has started (restart count) or when checkpoints are on (rank 0's
    # resume history; checkpoint figures at the end of training).
    restart_count: int | None = None
    resumes: list[ResumeRecord] | None = None
    checkpoint: CheckpointReport | None = None
    port: int | None = None  # the HTTP server's port, added by the server itself
    # Rank 0 after its first validation on the held-out split: the latest figures and their step
    # (accuracy for a classification loss only).
    validation_loss: float | None = None
    validation_accuracy: float | None = None
    validation_metric: float | None = None  # training.evaluation.metric's value, when the job names one
    validation_step: int | None = None
    # Rank 0, once its validation reached `training.target`: the step and the seconds since training
    # started; end_reason is then TARGET_REACHED and the job ends successfully at an agreed step.
    target_step: int | None = None
    time_to_target_s: float | None = None
    end_reason: str | None = None


TARGET_REACHED = "TargetReached"


class Termination(WireDocument):
    """How training ended, as rank 0 writes it to its container's termination message (a few hundred
    bytes; Kubernetes keeps up to 4 KiB). The operator reads it from the finished pod, so a target
    reached after its last scrape of the worker still ends the job as TargetReached."""

    step: int
    end_reason: str | None = None
    target_step: int | None = None
    time_to_target_s: float | None = None


def parse_termination(message: str) -> Termination | None:
    """The trainer's termination message, or None for anything else (logs on an error, a user's text)."""
    try:
        return Termination.model_validate_json(message)
    except ValueError:
        return None
