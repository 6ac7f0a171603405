"""`spec.runPolicy.schedulingPolicy`: gang scheduling of the worker pods, opt-in.

Named as in Kubeflow's RunPolicy.schedulingPolicy (minAvailable, queue, priorityClass,
scheduleTimeoutSeconds). Kubeflow picks the gang scheduler once per operator; here each job names
it (`gang`), so one cluster can run Volcano jobs and coscheduling jobs side by side.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import Field, model_validator

from sgdjob_trainer.config import CamelModel, cross_field_error

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class Gang(StrEnum):
    """Which gang scheduler places the worker pods all at once (or none of them)."""

    NONE = "none"
    VOLCANO = "volcano"
    COSCHEDULING = "coscheduling"


# The names the schedulers are installed under by their own manifests and charts.
DEFAULT_SCHEDULER = {Gang.VOLCANO: "volcano", Gang.COSCHEDULING: "scheduler-plugins-scheduler"}


class SchedulingPolicy(CamelModel):
    """Gang scheduling: a PodGroup owned by the job, so its workers start together or not at all."""

    gang: Annotated[
        Gang,
        Field(
            description=(
                "none, volcano (a scheduling.volcano.sh PodGroup) or coscheduling (a scheduling.x-k8s.io "
                "PodGroup of the scheduler-plugins coscheduling plugin)."
            )
        ),
    ] = Gang.NONE
    scheduler_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=_DNS_SUBDOMAIN,
            description=(
                "schedulerName of the worker pods. Defaults to volcano for gang volcano and "
                "scheduler-plugins-scheduler for gang coscheduling."
            ),
        ),
    ] = None
    min_available: Annotated[
        int | None,
        Field(
            ge=1,
            le=1024,
            description=(
                "Worker pods the scheduler must place together (PodGroup minMember). Defaults to minReplicas; "
                "never more than the replicas in force."
            ),
        ),
    ] = None
    queue: Annotated[
        str | None,
        Field(max_length=253, pattern=_DNS_SUBDOMAIN, description="Volcano queue of the PodGroup (gang volcano)."),
    ] = None
    priority_class: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=_DNS_SUBDOMAIN,
            description="PriorityClass of the PodGroup and of the worker pods.",
        ),
    ] = None
    schedule_timeout_seconds: Annotated[
        int | None,
        Field(
            ge=1,
            le=86_400,
            description=(
                "Seconds the coscheduling plugin waits for the whole group before it retries (gang coscheduling)."
            ),
        ),
    ] = None

    @model_validator(mode="after")
    def _per_gang(self) -> Self:
        if self.gang is Gang.NONE:
            for name, value in (
                ("schedulerName", self.scheduler_name),
                ("minAvailable", self.min_available),
                ("queue", self.queue),
                ("priorityClass", self.priority_class),
                ("scheduleTimeoutSeconds", self.schedule_timeout_seconds),
            ):
                if value is not None:
                    raise cross_field_error(name, f"{name} needs a gang scheduler: set gang to volcano or coscheduling")
        if self.queue is not None and self.gang is not Gang.VOLCANO:
            raise cross_field_error(
                "queue", "queue is a Volcano queue: set gang to volcano, or use a Kueue queue-name label instead"
            )
        if self.schedule_timeout_seconds is not None and self.gang is not Gang.COSCHEDULING:
            raise cross_field_error(
                "scheduleTimeoutSeconds",
                "scheduleTimeoutSeconds is the coscheduling plugin's: set gang to coscheduling",
            )
        return self

    @property
    def scheduler(self) -> str | None:
        """The worker pods' schedulerName, or None to leave the template's (or the default scheduler)."""
        if self.gang is Gang.NONE:
            return None
        return self.scheduler_name or DEFAULT_SCHEDULER[self.gang]

    def min_member(self, min_replicas: int, replicas: int) -> int:
        """PodGroup minMember: it counts pods, so a group never asks for more pods than the job has now
        (a rescale below minAvailable would otherwise leave every pod unschedulable)."""
        return max(1, min(self.min_available or min_replicas, replicas))


def check_against_spec(policy: SchedulingPolicy, template: dict[str, Any], max_replicas: int) -> None:
    """Rules between the scheduling policy and the rest of the spec (paths below spec)."""
    where = "runPolicy.schedulingPolicy"
    if policy.min_available is not None and policy.min_available > max_replicas:
        raise cross_field_error(
            f"{where}.minAvailable",
            f"minAvailable ({policy.min_available}) must be <= maxReplicas ({max_replicas}): "
            "the group could never be complete",
        )
    raw = template.get("spec")
    pod_spec: dict[str, Any] = raw if isinstance(raw, dict) else {}
    for ours, theirs, value in (
        ("schedulerName", "schedulerName", policy.scheduler),
        ("priorityClass", "priorityClassName", policy.priority_class),
    ):
        written = pod_spec.get(theirs)
        if value is not None and written is not None and written != value:
            raise cross_field_error(
                f"{where}.{ours}",
                f"{ours} gives {value!r} but template.spec.{theirs} is {written!r}: "
                f"remove template.spec.{theirs} or make them agree",
            )
