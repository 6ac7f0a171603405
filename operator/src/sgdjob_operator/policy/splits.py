"""When a new split of sync's batch is made: the margins it needs and when it need not persist.

A new split pauses nothing (the trainers apply it at a step boundary), so it may be made on less
evidence than a mode switch or a restart: a smaller margin once the speeds are known well
(`split_margin`), and at once when the gain is very large and the slowness is not a passing hiccup
(`fast`). `policy.engine` applies these rules; they live here so the engine stays one readable step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sgdjob_operator.policy.candidates import Candidate
from sgdjob_operator.policy.health import JobHealth
from sgdjob_operator.policy.job import JobView
from sgdjob_operator.policy.state import RankState

# A new split of sync's batch needs only this predicted gain (or switchMargin if smaller) once every
# rank's speed rests on RESPLIT_STEPS steps at its current batch (speeds.py): it pauses nothing, and
# an early split made from a short window is then corrected instead of kept for a whole run (a
# 0.5-s window gave three equal ranks 39, 39 and 36 samples, 8 % off, under a 10 % switchMargin).
# Ten steps: a 3x straggler split at once from its first 2-3 steps (14 samples where 13 is right,
# ~7 % slower steps) is corrected at step 21-27 instead of 42; a homogeneous fleet still made no
# split over 3 digits-cnn runs (its speeds agree to a few per cent over ten steps).
# Fitted on the tuning set: one-straggler, homogeneous; digits-cnn, interval 0.5 s, seeds 0-2 (b4c3c6f, 7ae3ef1).
RESPLIT_MARGIN = 0.03
RESPLIT_STEPS = 10
# Once every speed's error is measured (`state.SpeedEstimate.error`, from the spread of its windows),
# the margin is what that error allows: RESPLIT_SIGMAS standard errors of a gain that compares two
# ranks' speeds (sqrt 2 times one speed's), between RESPLIT_FLOOR and RESPLIT_MARGIN. A split from
# the first windows at equal batches can be off by one sample where a step has a part the speed
# factor does not scale (measured on the bimodal benchmark: the 2x pair read 1.92x slower at 32
# samples, 1.99x at the split, so 42/22 where 43/21 is right: +2 % predicted for the rest of the
# run and never made under a flat 3 %).
# Fitted on the tuning set: bimodal (homogeneous checked), digits-cnn, interval 0.5 s, seeds 0-2 (a417476).
RESPLIT_SIGMAS = 2.0
RESPLIT_FLOOR = 0.015
# A re-split also needs every speed to rest on this many (decayed) windows: a window's noise is shared
# by its steps (one long window of 30 steps is no better known than its noise), and a second window
# halves its variance.
# Fitted on the tuning set with RESPLIT_SIGMAS: bimodal, digits-cnn, interval 0.5 s, seeds 0-2 (a417476).
RESPLIT_WINDOWS = 1.9
# A new split of sync's batch predicting at least this gain is made on the first window that shows
# it, every rank's speed resting on FAST_STEPS steps, without waiting for persistenceIntervals: when
# the slowdown lasts, acting one interval sooner saves interval x gain/(1+gain) of the job's time,
# at least half an interval here (measured: a 3x straggler from the start, +125% on its first
# 3-step window, was split one interval later, 3 straggler-bound steps, ~0.25 s of a 9-s run);
# when it does not, the way back is one more split, and the wrong split in between (the straggler's
# share spread over the others) costs under a fifth of the step for the persistence it must show.
# At +40 % the saving is 0.29 of an interval, and a wrong split costs 0.1-0.3 of each step for the
# ~2 intervals the way back takes (a 1.5x rank of 4 / 2x on half the fleet), so acting at once pays
# unless most such windows are one-off blips. Measured on the bimodal benchmark (2x on half the
# fleet, +45 % on its first window): auto went from 1.03-1.05x to 1.00-1.01x the static
# speed-proportional split (3 seeds each). Milder gains (a 1.3x rank: +22 %) keep the persistence rule.
# Fitted on the tuning set: one-straggler (a896fab), bimodal (a417476); digits-cnn, interval 0.5 s, seeds 0-2.
FAST_GAIN = 0.4
FAST_STEPS = 2.0


def fast(
    chosen: Candidate,
    gain: float,
    health: JobHealth,
    world: int,
    candidates: Sequence[Candidate],
    switch: float,
    before: Mapping[int, RankState],
) -> bool:
    """A new split of sync's batch with a gain too large to wait a persistence out (FAST_GAIN),
    every rank of the world measured this window over FAST_STEPS steps, every slow rank slow since
    it began (`slow_from_start`), and no other change (stale modes waiting for their statistics
    included) predicting switchMargin more: that one (a mode switch) must show its persistence, and a
    split made at once in front of it would take the gain it is measured against and start the
    cooldown it must wait out."""
    big = chosen.batch_only and not chosen.restoring and gain >= FAST_GAIN
    best = max((c.prediction.useful for c in candidates), default=0.0)
    return (
        big
        and best <= chosen.prediction.useful * (1 + switch)
        and speeds_settled(health, world, FAST_STEPS)
        and slow_from_start(health, before)
    )


def slow_from_start(health: JobHealth, before: Mapping[int, RankState]) -> bool:
    """Every rank flagged slow this window has no earlier window in this world: it has been slow since
    it began, so the slowdown covers its whole first window. A rank that was measured at its normal
    speed before and is slow now may be in a hiccup shorter than a window (a window's mean cannot
    tell a 4x hiccup over a third of it from a steady 2x): that waits out persistence, as any change.
    Fitted on: the shipped hiccups-256 scenario (40 hiccups of 1-6 s at 4x in 10-s windows made 12
    rebalances under the fast rule alone) and the goodput benchmark's stragglers from step 0 (split
    on their first window)."""
    flagged = [r for r, h in health.ranks.items() if h.flagged]
    return bool(flagged) and all(before.get(r) is None or before[r].speed is None for r in flagged)


def speeds_settled(health: JobHealth, world: int, steps: float = RESPLIT_STEPS) -> bool:
    """Every rank of the world measured this window, each speed resting on `steps` steps."""
    ranks = [health.ranks.get(r) for r in range(world)]
    return all(h is not None and h.measured and h.evidence >= steps for h in ranks)


def split_margin(health: JobHealth, world: int) -> float | None:
    """The predicted gain a new split of sync's batch needs once every rank's speed rests on
    RESPLIT_STEPS steps and RESPLIT_WINDOWS windows (None before): what the speeds' measured errors
    allow, else RESPLIT_MARGIN."""
    if not speeds_settled(health, world) or any(health.ranks[r].windows < RESPLIT_WINDOWS for r in range(world)):
        return None
    errors = [health.ranks[r].error for r in range(world)]
    if any(e is None for e in errors):
        return RESPLIT_MARGIN
    worst = max(e for e in errors if e is not None)
    return min(RESPLIT_MARGIN, max(RESPLIT_FLOOR, RESPLIT_SIGMAS * math.sqrt(2.0) * worst))


def speed_noise(health: JobHealth, world: int) -> float:
    """RESPLIT_SIGMAS standard errors of a gain that compares two ranks' speeds (sqrt 2 times one
    speed's), from the world's least known speed: its measured error or what its window noise
    leaves it (`state.SpeedEstimate.noise`), the larger; 0.0 while neither is known."""
    errors = [
        e for r in range(world) if (h := health.ranks.get(r)) is not None for e in (h.error, h.noise) if e is not None
    ]
    return RESPLIT_SIGMAS * math.sqrt(2.0) * max(errors, default=0.0)


@dataclass(frozen=True, slots=True)
class SplitMargins:
    """What a new split of sync's batch is held to this window: `settled` (`split_margin`; None while
    the speeds are not settled or the last change's check has no verdict) and `noise` (`speed_noise`)."""

    settled: float | None = None
    noise: float = 0.0


def margin(c: Candidate, job: JobView, m: SplitMargins) -> float:
    """The predicted gain `c` needs: switchMargin, or, for a new split of sync's batch once the speeds
    are settled, `m.settled` if smaller; a new split at least `m.noise`: it rests on nothing but the
    speeds, and a gain inside their noise is the noise's."""
    if c.batch_only:
        base = job.policy.switch_margin if m.settled is None else min(job.policy.switch_margin, m.settled)
        return max(base, m.noise)
    return job.policy.switch_margin


def margin_text(c: Candidate, job: JobView, m: SplitMargins) -> str:
    """`margin` as a reason prints it, saying when the speeds' noise set it."""
    needed = margin(c, job, m)
    noisy = c.batch_only and m.noise > 0.0 and needed == m.noise
    return percent(needed) + (" for the speeds' window noise" if noisy else "")


def percent(x: float) -> str:
    """+10%, +1.5%: a margin to the precision it was set at."""
    return f"{x:+.0%}" if round(x * 100, 1) == round(x * 100) else f"{x:+.1%}"
