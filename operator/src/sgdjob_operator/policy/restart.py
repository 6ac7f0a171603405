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
