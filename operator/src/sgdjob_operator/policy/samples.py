"""What the policy reads: one scrape of one trainer process, as cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GradientSignal:
    """A process's moving averages over its steps in its current mode (see sgdjob_trainer.gradient_stats):
    |G|^2 of the true gradient, the per-sample gradient variance tr(S), and <G_t, G_t-1> (None
    until two consecutive steps). Estimates: each may come out negative when the noise dominates."""

    steps: int
    sq_norm: float
    variance: float
    lag_dot: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One trainer process at one instant. Counters are cumulative since the process started, so
    the policy works on differences between two samples; a counter that goes down means the
    process restarted. `time` is supplied by the shell (seconds), never read from a clock here."""

    rank: int
    time: float
    steps: int
    samples: int
    compute_seconds: float
    comm_wait_seconds: float
    mode: str
    batch_size: int
    node: str | None = None
    pod: str | None = None
    loss: float | None = None
    staleness: float = 0.0
    world_size: int = 0
    # Bytes of one gradient exchange (the model's parameter bytes); 0 when the trainer does not
    # say. With it the cost model prices communication instead of inferring it from waits.
    gradient_bytes: int = 0
    # Seconds this process had trained at `time`, on its own clock (None: not said, or not begun).
    # Its counters were all zero at `time - training_seconds`, which dates that zero in the shell's
    # clock without comparing two hosts' clocks.
    training_seconds: float | None = None
    # Gradient statistics from the process's steps in its current mode (None: none yet, or not said).
    gradient: GradientSignal | None = None
    # Seconds since the process last finished a step, and whether it is inside a step's own compute
    # now (None: not said). What tells a hung rank from the ranks waiting for it.
    stalled_seconds: float | None = None
    computing: bool | None = None
    # False when the process's optimizer cannot run in async mode (None: not said).
    async_capable: bool | None = None
    # False when the process cannot run hierarchical (a script on the adaptation API without what it
    # needs: adapt.hierarchy.obstacle); None: not said.
    hierarchical_capable: bool | None = None
    # True when the process's optimizer normalises its steps by the gradients' RMS (None: not said).
    adaptive_optimizer: bool | None = None
