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
# A shrink's cost before the job measured one: an agreed stop with a checkpoint, the survivors' world
# re-formed (3.2 s in tests/trainer/test_rendezvous_rounds.py) and their workers forked anew from warm
# agents, loading that checkpoint. A guess, replaced by the job's own figure after its first shrink.
SHRINK_GUESS_SECONDS = 10.0


def shrink_estimate(shrink_seconds: float | None, restart_seconds: float) -> float:
    """Seconds a shrink (a change that only removes workers) is expected to pause training: its own
    latest measured figure, else the lesser of SHRINK_GUESS_SECONDS and what a start measured. A shrink
    starts no process tree, pulls nothing and imports nothing; the job's first start paid for all of
    that, on its slowest node, so it says little of a shrink's cost (issue #37: ~20 s there, most of
    it the slow node importing torch, a world re-formed without that node in seconds)."""
    return shrink_seconds if shrink_seconds is not None else min(SHRINK_GUESS_SECONDS, restart_seconds)


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
