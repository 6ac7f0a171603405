"""A rank's speed, estimated over every window its configuration has run, not only the last one.

One window of a fast policy interval holds a few steps, so the speed it measures is noisy (a
0.5-s window of a digits-cnn rank: ~4 steps, warm-up included), and a batch split made from it is
off by a few samples. Summing work and compute since the rank's batch or mode last changed makes
the estimate more precise the longer a split runs, so that a split made early can be corrected
later by a small margin (`splits.split_margin`) instead of being kept for lack of evidence. The spread
of the summed windows' speeds gives the estimate's own error (`state.SpeedEstimate.error`).

The sum starts over when the configuration changes (a rank's samples per second depend on its
batch: a step has a cost that does not scale with it) and when a window departs from the estimate
by recoverThreshold or more, or by more than the rank's own windows vary (`_moved`): the rank's speed
changed (a straggler came or went); the new speed is then read from that window alone, as without
the estimate. A window measured from the process's
training start is not summed into the next ones (its first step carries one-off warm-up), and old
windows decay (`MEMORY_WINDOWS`) so that a drift too slow to count as a jump is still followed.

A speed in samples per second holds only at the batch it was measured at: a step also has a part
that does not grow with the batch (launches, the optimizer step, on a CPU the share of the cores the
other ranks leave), so a rank's samples per second fall as its batch shrinks. A split from speeds
alone misjudges how a rank's step changes with its batch (the more so the larger the fixed part; on
the digits-cnn benchmark it was 1.5-6 ms of a 70-ms step, a sample at most). When a rank's batch changes,
its estimate keeps the step time at the batch before (`prior_batch`, `prior_step`) as a second point,
and `step_overhead` fits `step(b) = fixed + b / rate` through the two, so the next split can equalise
the steps themselves. A window that spans the change (it ran both batches) is kept at a negligible
weight (`MIXED_WEIGHT`), so the new point rests on whole windows at the new batch.

Every estimate also carries the rank's spikes from the estimates before it: how far a window
departed from the estimate before it (at the same batch and mode) and the next one went back, the
departures that restarted an estimate included. On a node whose CPU quota throttles it in bursts (the real-node
benchmark's equal fleet: three 0.6-CPU nodes read 500 to 3,500 samples/s in 0.5-s windows, a
different rank slow each time) nearly every window departs, so every estimate rests on one or two
windows and never shows a spread of its own: a split from it looked +15-53 % better and was made
every 1-3 s, 10-16 times in 600 steps. The carried noise (`state.SpeedEstimate.noise`) says what a
speed from one or two windows of such a rank is worth, and the margin a split needs grows with it
(`splits.speed_noise`).

Beside the estimate each rank keeps its steady speed (`state.SpeedEstimate.steady`): its work and
compute over its last few windows in the mode (`STEADY_WINDOWS`), which neither a jump nor a new batch
starts over. A membership change rests on it (`candidates.steady_straggler`): the estimate follows a
jump at once, as a split should, but a node removed for one or two slow windows is a restart paid for
over the rest of the job.
"""

from __future__ import annotations

import math

from sgdjob_operator.policy.measure import RankWindow
from sgdjob_operator.policy.state import MIN_SPIKE_WINDOWS, MIN_SPREAD_WINDOWS, SpeedEstimate
from sgdjob_operator.policy.stats import MEMORY_WINDOWS

# The weight of a window that ran two batches, when it starts the new batch's estimate.
MIXED_WEIGHT = 1e-3
# The step-time fit needs its two batches this far apart (relative to the larger): a step time is
# known to a few per cent, and the fixed part's error grows as the batches approach each other.
FIT_MIN_SPREAD = 0.2
# Steps the estimate before a batch change must rest on to serve as the fit's second point.
PRIOR_MIN_STEPS = 2.0
# A fixed part above this share of the step at the smaller batch is taken for noise (the fit would
# call the batch nearly free and load the rank with samples) unless the fit is `_large_fit_allowed`.
MAX_FIXED_SHARE = 0.6
# A larger fixed part is real on a CPU-quota'd node: at 0.27 CPU a digits-cnn rank took 45 ms a step
# for 1 sample and 53 ms for 14 (the quota, not the batch, sets its step; real-node benchmark of
# 70d9443). Read as noise, the rank looked 3x, 6x, 20x, 39x slower per sample as its batch was cut, and
# each cut predicted a gain it never gave. It is accepted from a batch cut (the harm if wrong: the
# rank is cut less; a batch that grew with a flat step would load it with samples instead) whose
# new step rests on this many steps and (decayed) windows.
LARGE_FIXED_STEPS = 10.0
LARGE_FIXED_WINDOWS = 1.9
# A rank's speed within this many of its windows' spreads of its estimate has not moved.
NOISE_SIGMAS = 2.0
# A window this many of the rank's own spreads, and at least MIN_MOVE (log), off its estimate says the
# rank's speed moved, if by less than recoverThreshold: the estimate starts over from it. Summed with
# the windows before, such a move was followed over a decay of MEMORY_WINDOWS, and a fleet that turned
# equal read as dispersed for windows after (the randomized no-flapping search: ranks 7-44 % faster
# under 3.5 % noise, a split at the lagging speeds, then back to plain sync in the same phase).
MOVE_SIGMAS = 3.0
MIN_MOVE = 0.1
# Windows the steady speed remembers (`state.SpeedEstimate.steady`): each weighs (1 - 1/STEADY_WINDOWS)
# less than the one after it. Short enough that a rank slowed 3x reads as a straggler on it within
# about three windows (the default persistenceIntervals); long enough that one slow window does not:
# on real nodes of equal 0.6-CPU quotas, whose 0.5-s windows read 0.5-4x the median, no rank's
# steady speed read 1.5x slower in sync over 3 seeds x 600 steps (at most 1.40x), while the 0.27-CPU
# rank beside two 0.8-CPU ones read 2.0-4.7x from its first windows (bench/README.md).
STEADY_WINDOWS = 5.0


def _from_window(
    w: RankWindow,
    prior: tuple[int, float] = (0, 0.0),
    weight: float = 1.0,
    spikes: tuple[float, float, float] = (0.0, 0.0, 0.0),
    steady: tuple[float, float] = (0.0, 0.0),
) -> SpeedEstimate:
    work = w.speed * w.compute
    log = math.log(w.speed)
    return SpeedEstimate(
        work * weight,
        w.compute * weight,
        w.steps * weight,
        w.batch_size,
        w.mode,
        *prior,
        windows=weight,
        log_sum=log * weight,
        log_squares=log * log * weight,
        spike_squares=spikes[0],
        spike_windows=spikes[1],
        last_jump=spikes[2],
        # At full weight: what the steady speed says, that the rank is slow, a window over two batches says too.
        steady_work=steady[0] + work,
        steady_compute=steady[1] + w.compute,
    )


def _decayed_steady(previous: SpeedEstimate) -> tuple[float, float]:
    """`previous`'s steady sums, decayed by one window, to carry into the next estimate in the same
    mode: neither a jump nor a new batch starts them over. (A rank's samples per second fall a little
    with its batch, by the step's fixed part, so a rank whose batch was cut reads a little slower on
    them, as it does on its estimate; a new split after each slow window would otherwise leave the
    steady speed one or two windows deep, as the estimate is.)"""
    keep = 1.0 - 1.0 / STEADY_WINDOWS
    return previous.steady_work * keep, previous.steady_compute * keep


def _spikes(previous: SpeedEstimate | None, w: RankWindow | None = None) -> tuple[float, float, float]:
    """The spikes `previous` carries (decayed by one window) with `w` counted (None: a window at
    another batch or mode, whose departure is the change's doing, not noise): `w`'s departure from
    `previous`, as a log ratio, is a spike where it goes back against the window before's, by the
    smaller of the two (a rank that slowed for a window and came back); a departure that stays (a
    straggler came, a batch was cut) counts nothing, so a real change does not read as noise."""
    if previous is None:
        return 0.0, 0.0, 0.0
    keep = 1.0 - 1.0 / MEMORY_WINDOWS
    squares, count = previous.spike_squares * keep, previous.spike_windows * keep
    if w is None:
        return squares, count, 0.0
    jump = math.log(w.speed / previous.speed)
    last = previous.last_jump
    spike = min(abs(jump), abs(last)) if jump * last < 0 else 0.0
    return squares + spike * spike, count + 1.0, jump


def _mixed(w: RankWindow) -> bool:
    """The window ran more than one batch size (its samples are not steps x batch)."""
    return w.mode != "async" and w.samples != w.steps * w.batch_size


def _prior(previous: SpeedEstimate) -> tuple[int, float]:
    """The second point a new batch's estimate keeps: the step time before the change, or, when that
    rests on too few steps, the point it kept itself."""
    if previous.steps >= PRIOR_MIN_STEPS:
        return previous.batch, previous.compute / previous.steps
    return previous.prior_batch, previous.prior_step


def _spread(previous: SpeedEstimate) -> float | None:
    """The rank's window-to-window spread (log): its spikes, else its windows' spread; None while
    neither is measured."""
    if previous.spike_windows >= MIN_SPIKE_WINDOWS:
        return math.sqrt(previous.spike_squares / previous.spike_windows)
    if previous.windows >= MIN_SPREAD_WINDOWS:
        mean = previous.log_sum / previous.windows
        return math.sqrt(max(0.0, previous.log_squares / previous.windows - mean * mean))
    return None


def _within_noise(previous: SpeedEstimate, ratio: float) -> bool:
    """A window `ratio` times the estimate's speed is within NOISE_SIGMAS of the rank's window-to-window
    spread (`_spread`; not measured yet: within `departure`, as the estimate itself reads it)."""
    spread = _spread(previous)
    return spread is None or abs(math.log(ratio)) <= NOISE_SIGMAS * spread


def _moved(previous: SpeedEstimate, ratio: float) -> bool:
    """A window `ratio` times the estimate's speed is off it by more than the rank's windows vary
    (MOVE_SIGMAS of its measured spread, and MIN_MOVE); False while that spread is not measured."""
    spread = _spread(previous)
    return spread is not None and abs(math.log(ratio)) > max(MIN_MOVE, MOVE_SIGMAS * spread)


def step_overhead(est: SpeedEstimate | None) -> float:
    """The seconds of a step that do not grow with the batch, from the rank's step times at its
    current and prior batch (0.0 when there is no prior point, the batches are too close, or the
    fit is not credible: a negative fixed part, or one above MAX_FIXED_SHARE that
    `_large_fit_allowed` does not vouch for). A step that did not grow with the batch is read by
    `_flat_cut`."""
    if est is None or est.prior_batch <= 0 or est.prior_step <= 0 or est.steps <= 0:
        return 0.0
    b1, t1 = est.batch, est.compute / est.steps
    b0, t0 = est.prior_batch, est.prior_step
    if abs(b1 - b0) < FIT_MIN_SPREAD * max(b0, b1):
        return 0.0
    per_sample = (t1 - t0) / (b1 - b0)
    if per_sample <= 0:
        return _flat_cut(est, t0, t1)
    fixed = t1 - per_sample * b1
    smaller = t0 if b0 < b1 else t1
    if fixed <= 0 or (fixed > MAX_FIXED_SHARE * smaller and not _large_fit_allowed(est)):
        return 0.0
    return fixed


def _flat_cut(est: SpeedEstimate, t0: float, t1: float) -> float:
    """The fixed part of a rank whose step did not fall when its batch was cut (0.0 unless the cut is
    measured as `_large_fit_allowed` asks). No line through the two points has a positive slope, and
    reading none (a proportional step) predicts the largest gain of all from cutting it again: on a
    real node bound by its CPU quota (0.27 CPU, on a machine whose other ranks took the rest) the slow
    rank's step took 80-120 ms at 32, 8 and 3 samples alike, and each cut predicted +170-220 %. The
    slope taken is the largest the larger batch's step allows (all of the smaller step time spent on
    the larger batch's samples), through the step measured now: a further cut then predicts at most
    that share back."""
    if not _large_fit_allowed(est):
        return 0.0
    return t1 - est.batch * min(t0, t1) / est.prior_batch


def _large_fit_allowed(est: SpeedEstimate) -> bool:
    """A fixed part over MAX_FIXED_SHARE is believed after a cut of the rank's batch, measured at the
    new batch over LARGE_FIXED_STEPS steps and LARGE_FIXED_WINDOWS windows."""
    return est.batch < est.prior_batch and est.steps >= LARGE_FIXED_STEPS and est.windows >= LARGE_FIXED_WINDOWS


def running_speed(
    previous: SpeedEstimate | None, w: RankWindow, from_start: bool, departure: float, afresh: bool = False
) -> tuple[float, SpeedEstimate | None]:
    """The rank's speed after window `w` and the estimate to keep for the next window (None after a
    window from the training start). `previous` must be the same worker's (see measure.same_worker);
    `departure` is the speed ratio at which a window starts a new estimate; `afresh`: start one from
    `w` whatever it departs by (the fleet's shape changed), keeping only the rank's noise."""
    if from_start:
        return w.speed, None
    if previous is None or previous.mode != w.mode:
        fresh = _from_window(w, spikes=_spikes(previous))
        return fresh.speed, fresh
    if previous.batch != w.batch_size:
        prior = _prior(previous)
        weight = MIXED_WEIGHT if _mixed(w) else 1.0
        return w.speed, _from_window(w, prior, weight, _spikes(previous), _decayed_steady(previous))
    ratio = w.speed / previous.speed
    # (Not against a mixed window's seed, which weighs a small fraction of one step: its speed blends
    # two batches; nor is its departure noise.)
    counted = previous.steps >= 1.0
    spikes = _spikes(previous, w if counted else None)
    departed = (max(ratio, 1.0 / ratio) >= departure or _moved(previous, ratio)) and counted
    if afresh or departed:
        # The rank's speed changed: the prior point described the old speed. A rank started afresh
        # only because the fleet's shape changed, its own speed where it was (within its own windows'
        # noise), keeps the point: the shape of a CPU-quota'd fleet changes with the bursts of its
        # other ranks, and a rank that lost its fit at each would be cut again on a proportional
        # reading (speeds.step_overhead). A rank whose speed moved by more than its noise, if less
        # than `departure`, drops it: a point from its old speed fits a fixed part that is not there
        # (the randomized no-flapping search: 20 % slower under 3 % noise, a split, then async).
        kept = not departed and _within_noise(previous, ratio)
        prior = (previous.prior_batch, previous.prior_step) if kept else (0, 0.0)
        fresh = _from_window(w, prior, spikes=spikes, steady=_decayed_steady(previous))
        return fresh.speed, fresh
    fresh = _from_window(w, steady=_decayed_steady(previous))
    keep = 1.0 - 1.0 / MEMORY_WINDOWS
    summed = SpeedEstimate(
        previous.work * keep + fresh.work,
        previous.compute * keep + fresh.compute,
        previous.steps * keep + fresh.steps,
        w.batch_size,
        w.mode,
        previous.prior_batch,
        previous.prior_step,
        previous.windows * keep + fresh.windows,
        previous.log_sum * keep + fresh.log_sum,
        previous.log_squares * keep + fresh.log_squares,
        *spikes,
        fresh.steady_work,
        fresh.steady_compute,
    )
    return summed.speed, summed
