"""A rank's speed, estimated over every window its configuration has run, not only the last one.

One window of a fast policy interval holds a few steps, so the speed it measures is noisy (a
0.5-s window of a digits-cnn rank: ~4 steps, warm-up included), and a batch split made from it is
off by a few samples. Summing work and compute since the rank's batch or mode last changed makes
the estimate more precise the longer a split runs, so that a split made early can be corrected
later by a small margin (`engine.RESPLIT_MARGIN`) instead of being kept for lack of evidence.

The sum starts over when the configuration changes (a rank's samples per second depend on its
batch: a step has a cost that does not scale with it) and when a window departs from the estimate
by recoverThreshold or more (the rank's speed changed: a straggler came or went; the new speed is
then read from that window alone, as without the estimate). A window measured from the process's
training start is not summed into the next ones (its first step carries one-off warm-up), and old
windows decay (`MEMORY_WINDOWS`) so that a drift too slow to count as a jump is still followed.
"""

from __future__ import annotations

from sgdjob_operator.policy.measure import RankWindow
from sgdjob_operator.policy.state import SpeedEstimate

# Windows an estimate remembers: each summed window weighs (1 - 1/MEMORY_WINDOWS) less than the
# one after it.
MEMORY_WINDOWS = 10


def _from_window(w: RankWindow) -> SpeedEstimate:
    return SpeedEstimate(w.speed * w.compute, w.compute, float(w.steps), w.batch_size, w.mode)


def running_speed(
    previous: SpeedEstimate | None, w: RankWindow, from_start: bool, departure: float
) -> tuple[float, SpeedEstimate | None]:
    """The rank's speed after window `w` and the estimate to keep for the next window (None after a
    window from the training start). `previous` must be the same worker's (see measure.same_worker);
    `departure` is the speed ratio at which a window starts a new estimate."""
    if from_start:
        return w.speed, None
    fresh = _from_window(w)
    if previous is None or (previous.batch, previous.mode) != (w.batch_size, w.mode):
        return fresh.speed, fresh
    ratio = w.speed / previous.speed
    if max(ratio, 1.0 / ratio) >= departure:
        return fresh.speed, fresh
    keep = 1.0 - 1.0 / MEMORY_WINDOWS
    summed = SpeedEstimate(
        previous.work * keep + fresh.work,
        previous.compute * keep + fresh.compute,
        previous.steps * keep + fresh.steps,
        w.batch_size,
        w.mode,
    )
    return summed.speed, summed
