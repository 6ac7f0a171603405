"""Scenario files for `sgdjob simulate`: a fleet, what happens to it, the network and the job.

Validated by pydantic with camelCase fields (like the SGDJob API), so an error names the field as
written in the YAML: `events[2].factor: Input should be greater than or equal to 1`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import Field, ValidationError, model_validator

from sgdjob_operator.api.models import JobMode, SGDJobSpec
from sgdjob_operator.api.validation import format_errors
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.job import REBALANCE_SECONDS
from sgdjob_trainer.config import CamelModel, cross_field_error

MAX_SIM_WORKERS = 1024


class GpuType(CamelModel):
    """Identical nodes of one kind."""

    name: Annotated[str, Field(min_length=1, max_length=64, description="Label, e.g. A100.")]
    nodes: Annotated[int, Field(ge=1, le=MAX_SIM_WORKERS, description="How many nodes of this kind.")]
    speed: Annotated[float, Field(gt=0, le=1e7, description="Samples per second of one GPU when it never waits.")]
    max_batch: Annotated[
        int | None, Field(ge=1, le=65_536, description="Largest per-GPU batch its memory holds (caps rebalancing).")
    ] = None


class Slowdown(CamelModel):
    """Nodes whose compute takes `factor` times longer from atSeconds (until untilSeconds)."""

    kind: Literal["slowdown"]
    nodes: Annotated[list[int], Field(min_length=1, max_length=MAX_SIM_WORKERS)]
    at_seconds: Annotated[float, Field(ge=0)]
    until_seconds: Annotated[float | None, Field(gt=0)] = None
    factor: Annotated[float, Field(ge=1.0, le=1000.0)]


class Drift(CamelModel):
    """Gradual degradation: the slowdown grows linearly from 1 to `factor` between the times, then stays."""

    kind: Literal["drift"]
    nodes: Annotated[list[int], Field(min_length=1, max_length=MAX_SIM_WORKERS)]
    start_seconds: Annotated[float, Field(ge=0)]
    end_seconds: Annotated[float, Field(gt=0)]
    factor: Annotated[float, Field(ge=1.0, le=1000.0)]


class Hiccups(CamelModel):
    """`count` short slowdowns of random nodes at random times (a noisy neighbour, a GC pause)."""

    kind: Literal["hiccups"]
    count: Annotated[int, Field(ge=1, le=100_000)]
    duration_seconds: Annotated[tuple[float, float], Field(description="Shortest and longest hiccup.")]
    factor: Annotated[float, Field(ge=1.0, le=1000.0)]


class Death(CamelModel):
    """Nodes that stop at atSeconds; the job notices failureDetectSeconds later."""

    kind: Literal["death"]
    nodes: Annotated[list[int], Field(min_length=1, max_length=MAX_SIM_WORKERS)]
    at_seconds: Annotated[float, Field(ge=0)]


Event = Annotated[Slowdown | Drift | Hiccups | Death, Field(discriminator="kind")]


class Network(CamelModel):
    """Alpha-beta network and model size (the same model the policy's cost model assumes)."""

    latency_seconds: Annotated[float, Field(ge=0, le=1.0)] = 2e-5
    bandwidth_gbps: Annotated[float, Field(gt=0, le=10_000, description="Gigabytes per second of one link.")] = 12.5
    gradient_mb: Annotated[
        float, Field(ge=0, le=1e6, description="Megabytes of one gradient (the model's parameters).")
    ] = 100.0
    ps_apply_seconds: Annotated[
        float, Field(ge=0, le=1.0, description="A parameter-server shard's fixed work per push.")
    ] = 5e-4


class Costs(CamelModel):
    """What changes cost. A membership change restarts every worker from the latest checkpoint."""

    restart_seconds: Annotated[float, Field(ge=0, le=3600)] = 60.0
    switch_seconds: Annotated[float, Field(ge=0, le=600)] = 5.0
    # A new split lands at a step boundary without a restart (under 20 ms measured on digits-cnn):
    # the policy's own figure, so the simulator does not charge a re-split five times what it costs.
    rebalance_seconds: Annotated[float, Field(ge=0, le=600)] = REBALANCE_SECONDS
    failure_detect_seconds: Annotated[float, Field(ge=0, le=3600)] = 30.0


class Scenario(CamelModel):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    description: Annotated[str, Field(max_length=4096)] = ""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    nproc_per_node: Annotated[int, Field(ge=1, le=64)] = 1
    fleet: Annotated[list[GpuType], Field(min_length=1, max_length=64)]
    duration_seconds: Annotated[float | None, Field(gt=0, le=1e7)] = None
    steps: Annotated[
        int | None,
        Field(ge=1, le=10_000_000, description="Run as long as this many plain-sync steps take on the nominal fleet."),
    ] = None
    noise: Annotated[
        float, Field(ge=0, le=2.0, description="Per-step compute noise (sigma of a mean-1 lognormal).")
    ] = 0.03
    network: Network = Network()
    costs: Costs = Costs()
    job: Annotated[
        dict[str, Any],
        Field(description="SGDJob spec fields (training, policy, minReplicas...); replicas comes from the fleet."),
    ] = {}
    events: Annotated[list[Event], Field(max_length=10_000)] = []

    @property
    def nodes(self) -> int:
        return sum(t.nodes for t in self.fleet)

    @property
    def workers(self) -> int:
        return self.nodes * self.nproc_per_node

    def comm(self) -> CommModel:
        n = self.network
        return CommModel(n.latency_seconds, n.bandwidth_gbps * 1e9, round(n.gradient_mb * 1e6), n.ps_apply_seconds)

    @property
    def duration(self) -> float:
        """The run's length: durationSeconds, or `steps` plain-sync steps of the nominal fleet."""
        if self.duration_seconds is not None:
            return self.duration_seconds
        batch = self.spec(JobMode.AUTO).training.batch_size
        step = batch / min(g.speed for g in self.fleet) + self.comm().allreduce_s(self.workers)
        return float(self.steps or 0) * step

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.duration_seconds is None) == (self.steps is None):
            raise cross_field_error("durationSeconds", "give exactly one of durationSeconds or steps")
        if self.workers > MAX_SIM_WORKERS:
            raise cross_field_error("fleet", f"{self.workers} workers exceed {MAX_SIM_WORKERS}")
        for i, event in enumerate(self.events):
            for node in getattr(event, "nodes", []):
                if node >= self.nodes:
                    raise cross_field_error(
                        f"events[{i}].nodes",
                        f"node {node} does not exist (the fleet has {self.nodes} nodes, 0..{self.nodes - 1})",
                    )
            if isinstance(event, Drift) and event.end_seconds <= event.start_seconds:
                raise cross_field_error(f"events[{i}].endSeconds", "endSeconds must be after startSeconds")
            if (
                isinstance(event, Slowdown)
                and event.until_seconds is not None
                and event.until_seconds <= event.at_seconds
            ):
                raise cross_field_error(f"events[{i}].untilSeconds", "untilSeconds must be after atSeconds")
            if isinstance(event, Hiccups) and not 0 < event.duration_seconds[0] <= event.duration_seconds[1]:
                raise cross_field_error(
                    f"events[{i}].durationSeconds", "give [shortest, longest] with 0 < shortest <= longest"
                )
        try:
            self.spec(JobMode.AUTO)
        except ValidationError as err:
            raise cross_field_error("job", "; ".join(format_errors(err))) from err
        return self

    def spec(self, mode: JobMode) -> SGDJobSpec:
        """The SGDJob spec the simulated job runs: the scenario's `job` with the fleet's replicas;
        elastic by one node unless the scenario says otherwise, so a replacement can proceed."""
        data = dict(self.job)
        data["replicas"] = self.nodes
        data.setdefault("minReplicas", max(1, self.nodes - 1))
        data.setdefault("maxReplicas", self.nodes)
        data["nprocPerNode"] = self.nproc_per_node
        data["mode"] = mode.value
        return SGDJobSpec.model_validate(data)


class ScenarioError(ValueError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def load_scenario(path: Path) -> Scenario:
    """Read and validate one scenario file; ScenarioError lists 'field: message' problems."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ScenarioError(str(path), [f"(document): {err}"]) from err
    if not isinstance(data, dict):
        raise ScenarioError(str(path), ["(document): a scenario is a mapping"])
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(str(path), format_errors(err)) from err
