"""How long a (re)start of the job's world took, from the workers' own samples (pure).

A rank's process says how long it has trained (`WorkerSample.training_seconds`), which dates its start
of training in the shell's clock; a world began when its last rank did. Both shells (the operator and
the one-machine runner) measure their restarts this way, so the policy's payback rule weighs a
membership change by what one costs on that platform, not by a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgdjob_operator.policy.samples import WorkerSample

# A measured restart is never taken below this: a scrape dates a start to about a second.
MIN_RESTART_SECONDS = 1.0
# A shrink's cost before the job measured one: the world stops at an agreed step with a checkpoint,
# the survivors' agents re-form their world at the intended size (the removed agent taken off at
# once, the store read at every poll: sgdjob_trainer.rendezvous_rounds), and their workers, forked
# anew from warm agents, load that checkpoint. Its fixed part is what a small model's shrink measured,
# rounded up: 2.1-2.8 s on kubelet nodes of 0.8 CPU, 1.0 s on one machine (2026-12-06; the guess was
# 10 s while a shrink's rendezvous waited torch's one-second polls, 3.4-4.4 s measured then).
SHRINK_FIXED_SECONDS = 3.0
# What the checkpoint adds: written, then read, with up to two optimizer moments beside the parameters
# (3x the gradient's bytes each way), at a rate a shared network volume sustains.
CHECKPOINT_BYTES_PER_SECOND = 100e6


def shrink_guess(model_bytes: int) -> float:
    """Seconds a shrink of a job whose gradient is `model_bytes` is taken to pause training before one
    is measured (0: size unknown, the fixed part alone)."""
    return SHRINK_FIXED_SECONDS + 2 * 3 * max(0, model_bytes) / CHECKPOINT_BYTES_PER_SECOND


def shrink_estimate(
    shrink_seconds: float | None, restart_seconds: float, samples: Sequence[WorkerSample] = ()
) -> float:
    """Seconds a shrink (a change that only removes workers) is expected to pause training: its own
    latest measured figure, else the lesser of `shrink_guess` (for the model the samples report) and
    what a start measured. A shrink starts no process tree, pulls nothing and imports nothing; the
    job's first start paid for all of that, on its slowest node, so it says little of a shrink's cost
    (issue #37: ~20 s there, most of it the slow node importing torch, a world re-formed without that
    node in seconds)."""
    if shrink_seconds is not None:
        return shrink_seconds
    model_bytes = max((s.gradient_bytes for s in samples), default=0)
    return min(shrink_guess(model_bytes), restart_seconds)


def world_began(samples: Sequence[WorkerSample]) -> float | None:
    """When the last rank of the newest world began training (None unless every rank of it says)."""
    world = max((s.world_size for s in samples), default=0)
    began = {
        s.rank: s.time - s.training_seconds
        for s in samples
        if s.world_size == world and s.training_seconds is not None and 0 <= s.rank < world
    }
    return max(began.values()) if world > 0 and len(began) == world else None


def restart_took(samples: Sequence[WorkerSample], since: float) -> float | None:
    """Seconds from `since` (a membership change, a launch) until every rank of the newest world
    trained; None until then, and while the samples are still the old world's (began before `since`)."""
    began = world_began(samples)
    if began is None or began <= since:
        return None
    return round(max(MIN_RESTART_SECONDS, began - since), 3)
