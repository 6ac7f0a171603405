"""Emulation settings of `spec.training`: slowdowns that stand in for unequal accelerators on a
CPU-only machine, and injected faults (crash, hang) for recovery tests.

Free of torch, like `sgdjob_trainer.config`, which re-exports every name here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import Field, model_validator

from sgdjob_trainer.config_base import CamelModel, cross_field_error


class SpeedChange(CamelModel):
    """An emulated slowdown (a spell): one rank's (or every rank on one node's) step time is multiplied,
    over a step range or a time range (seconds since the worker process began training)."""

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

    start_seconds: Annotated[
        float | None,
        Field(
            ge=0.0,
            le=31_536_000.0,
            description=(
                "Start of the slowdown in seconds since the worker began training (instead of startStep; a "
                "restarted worker counts from its restart)."
            ),
        ),
    ] = None
    end_seconds: Annotated[
        float | None,
        Field(
            gt=0.0,
            le=31_536_000.0,
            description="End of the slowdown in seconds since the worker began training (exclusive; not with endStep).",
        ),
    ] = None

    @property
    def by_time(self) -> bool:
        return self.start_seconds is not None or self.end_seconds is not None

    @model_validator(mode="after")
    def _target(self) -> Self:
        if (self.rank is None) == (self.node is None):
            raise cross_field_error("rank", "give exactly one of rank or node for a slowdown")
        if self.end_step is not None and self.end_step <= self.start_step:
            raise cross_field_error(
                "endStep", f"endStep ({self.end_step}) must be greater than startStep ({self.start_step})"
            )
        if self.by_time and (self.start_step != 0 or self.end_step is not None):
            raise cross_field_error(
                "startSeconds", "give the slowdown's range in steps (startStep/endStep) or in seconds, not both"
            )
        if self.end_seconds is not None and self.end_seconds <= (self.start_seconds or 0.0):
            raise cross_field_error(
                "endSeconds",
                f"endSeconds ({self.end_seconds:g}) must be greater than startSeconds ({self.start_seconds or 0.0:g})",
            )
        return self


class Bursts(CamelModel):
    """Noise that comes in bursts, not independently per step: the run is cut into blocks of `steps`
    steps, and each block of each rank is, with `probability`, a burst whose steps all take `factor`
    times as long (a noisy neighbour, a GC pause, a thermal dip). Drawn from the job's seed, rank and
    block, so a rerun or a resumed worker sees the same bursts."""

    probability: Annotated[
        float, Field(ge=0.0, le=1.0, description="Chance that a block of steps is a burst (per rank and block).")
    ] = 0.05
    steps: Annotated[int, Field(ge=1, le=1_000_000, description="Length of a block (and so of a burst), in steps.")] = (
        10
    )
    factor: Annotated[
        float, Field(ge=1.0, le=100.0, description="Multiplier of the step time during a burst: 2 = twice as long.")
    ] = 2.0


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
            description=(
                "Emulated per-sample compute of one step at factor 1, given for the configured batch size: a step "
                "of b samples takes fixedSeconds + computeSeconds x b / batchSize. 0 with no fixedSeconds: no sleep."
            ),
        ),
    ] = 0.05
    fixed_seconds: Annotated[
        float,
        Field(
            ge=0.0,
            le=60.0,
            description=(
                "Emulated per-step part that does not grow with the batch (launches, optimizer, framework "
                "overhead); the slowdown factor applies to it too. 0 (the default): the step is all per-sample."
            ),
        ),
    ] = 0.0
    bursts: Annotated[
        Bursts | None, Field(description="Bursty noise: runs of slow steps rather than independent per-step jitter.")
    ] = None
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
    cpu_limits: Annotated[
        list[Annotated[float, Field(ge=0.01, le=1024.0)]] | None,
        Field(
            max_length=1024,
            description=(
                "Real slow nodes, not a sleep: one CPU limit per worker (agent local-0, local-1, ...), in CPUs, "
                "applied by `sgdjob run` as a real cgroup CPU quota on that agent and its trainer processes "
                "(0.27 = 2.7 ms of CPU in every 10 ms). One value per replica; agents added later (replacements, "
                "scale-up) run unlimited. Set computeSeconds: 0 for real compute only. Ignored on Kubernetes, "
                "where a pod's resources.limits.cpu does the same."
            ),
        ),
    ] = None


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
