"""Hangs: a rank that finishes no step for `policy.hangTimeoutSeconds` is not slow, it is stuck.

Level-based: every figure comes from the trainers' own clocks at the scrape (`stalled_seconds`,
seconds since the process last finished a step, and `computing`, whether it is inside a step's own
compute), so a restarted controller sees the same hang at once. In synchronous modes a rank stuck
in its compute (a wedged GPU, a dead file system under its data) stops every rank: the others wait
in the next exchange, stalled as long, but not computing, which names the culprit. When every rank
that answers is stalled and none is computing, the job as a whole stopped (a collective that never
completes, or a rank that no longer answers): a rank that does not answer is blamed, else rank 0,
whose replacement restarts the round from the last checkpoint all the same. A job where some ranks
still move (async: a rank waiting on a slow peer) has no hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sgdjob_operator.policy.samples import WorkerSample


@dataclass(frozen=True, slots=True)
class Hang:
    """`stuck`: the rank is stuck in its own compute; False: the whole job stopped and `rank` is
    the one whose replacement restarts it (one that no longer answers, else rank 0)."""

    rank: int
    pod: str | None
    stalled_s: float
    stuck: bool

    def reason(self, timeout: float) -> str:
        where = f"rank {self.rank}" + (f" (pod {self.pod})" if self.pod else "")
        if self.stuck:
            return (
                f"hang: {where} has finished no step for {self.stalled_s:.0f}s (hangTimeoutSeconds {timeout:g}) "
                "and is stuck in its own compute while the others wait"
            )
        return (
            f"hang: no rank has finished a step for {self.stalled_s:.0f}s (hangTimeoutSeconds {timeout:g}) and none "
            f"is computing; replacing {where} restarts the round from the last checkpoint"
        )


def find_hang(latest: Mapping[int, WorkerSample], world_size: int, timeout: float | None) -> Hang | None:
    """The hang in these samples (the newest of each rank), if any (pure)."""
    if timeout is None:
        return None
    stalled = [s for s in latest.values() if s.stalled_seconds is not None and s.stalled_seconds >= timeout]
    if not stalled:
        return None
    stuck = [s for s in stalled if s.computing]
    if stuck:
        worst = max(stuck, key=lambda s: (s.stalled_seconds or 0.0, -s.rank))
        return Hang(worst.rank, worst.pod, worst.stalled_seconds or 0.0, True)
    if len(stalled) < len(latest):
        return None
    longest = max(s.stalled_seconds or 0.0 for s in stalled)
    silent = [r for r in range(world_size) if r not in latest]
    if silent:
        return Hang(silent[0], None, longest, False)
    first = latest[min(latest)]
    return Hang(first.rank, first.pod, longest, False)
