"""A change checked by its own results: a mode switch or new split that under-delivers is taken back.

The cost model predicts what a change is worth from measured speeds and from gradient statistics
measured in the mode the job runs *before* the change; a stale mode's worth then rests on a
correlation measured in another mode (a job that went hierarchical at +65 % saw its validation
accuracy stall for ~950 steps, and left only when the cooldown, persistence and a fresh prediction
allowed). So every such change (not the way back to plain sync, which is where an equal fleet
rests, nor a membership change, after which the fleet is another one) opens a `Trial` that keeps
its prediction and the measured progress of the configuration it left (`policy.progress`).

Once the new configuration has its own evidence (it has landed; whole windows of it at its own
statistical efficiency, measured in it over as many steps as a stale mode needs before it is chosen;
RESPLIT_WINDOWS windows; and, with the left configuration's windows, the degrees of freedom a
speed's measured error needs), its mean useful samples/s is compared with the left configuration's.
Below it by more than RESPLIT_SIGMAS standard errors of the difference (from the two tallies' pooled
window spread: the measured noise, no new tolerance), the job goes back at once, without waiting for
persistence or the cooldown; above it by as much, the change is confirmed and the trial closes. A
trial on a fleet whose shape changed meanwhile (a shape that held for persistenceIntervals windows,
`engine.settled_shape`), or still undecided after the horizon a change must repay its pause in,
closes without a verdict: the comparison would mean nothing.

A fleet can also move without changing its shape's name (a 1.6x spread becomes 2x): a split whose
trial runs across that move would be blamed (or praised) for it. `fleet_drift` reads the move from
each rank's speed now against its speed when the left configuration's tally began, beyond what the
change of its batch alone can explain; the verdict must hold with and without the move, and a move
larger than the change's predicted gain leaves no verdict at all.

A change taken back is not made again on the same prediction: on the same fleet shape its
predictions count at what it delivered over what it promised (`Discount`), for one horizon, twice
as long each time it is taken back again while remembered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sgdjob_operator.api.models import Action
from sgdjob_operator.policy.candidates import Candidate
from sgdjob_operator.policy.cost import Prediction
from sgdjob_operator.policy.decisions import Decision, Rebalance, SwitchMode
from sgdjob_operator.policy.efficiency import Efficiency
from sgdjob_operator.policy.job import JobView
from sgdjob_operator.policy.measure import Window
from sgdjob_operator.policy.progress import Progress, pooled_error
from sgdjob_operator.policy.splits import RESPLIT_SIGMAS, RESPLIT_WINDOWS
from sgdjob_operator.policy.state import MIN_SPREAD_WINDOWS
from sgdjob_operator.policy.trial import Discount, Trial
from sgdjob_trainer.config import SyncMode

# A discount's time doubles with each take-back at most this often (about a thousand horizons: days
# at the default settings). A bound for the arithmetic, not a fitted value.
MAX_DOUBLINGS = 10


class Outcome(StrEnum):
    WAIT = "wait"  # not enough evidence yet
    KEPT = "kept"  # delivers more than the configuration it left: the trial closes
    REVERT = "revert"  # delivers less, beyond the noise: go back
    VOID = "void"  # no trial, or one whose comparison means nothing any more


@dataclass(frozen=True, slots=True)
class Verdict:
    """`measured`: the measured gain over the left configuration, `error` its standard error (both
    relative to the left configuration's progress); `ratio`: measured over predicted useful
    samples/s, within [0, 1]; `steps`: the job's steps since the change; `useful`: the new
    configuration's measured useful samples/s."""

    outcome: Outcome
    measured: float = 0.0
    error: float = 0.0
    ratio: float = 1.0
    steps: int = 0
    useful: float = 0.0


def gain_text(gain: float) -> str:
    """A gain as a reason prints it: '+51%', or words where the configuration it is relative to makes
    no measured useful progress (a gain over nothing is no percentage: never '+inf%' or 'nan%')."""
    if math.isnan(gain):
        return "gain unknown"
    if math.isinf(gain * 100):  # * 100: a finite gain over a denormal rate overflows as a percentage
        return "no useful progress measured now"
    return f"{gain:+.0%}"


def window_starts(window: Window) -> dict[int, float]:
    """When each measured rank's window began; a window from the process's training start is left
    out (its first steps carry one-off warm-up)."""
    return {r: window.latest[r].time - w.seconds for r, w in window.ranks.items() if r not in window.from_start}


def window_useful(
    window: Window, throughput: float, current: Prediction, efficiency: Efficiency, mode: str, wait_steps: int
) -> float | None:
    """The window's useful samples/s in the configuration in force: the samples/s the ranks applied
    times what a sample is worth in it (`current.efficiency`). None when the window is no measure of
    it: a rank still in another mode, or a stale mode whose trainers measure gradient statistics
    that do not yet rest on `wait_steps` steps in it (the worth would be the prior the prediction
    assumed, which would check the prediction against itself). Trainers that never measure leave the
    prior on both sides, and the check then compares throughput."""
    if throughput <= 0 or any(w.mode != mode for w in window.ranks.values()):
        return None
    measuring = any(s.gradient is not None for s in window.latest.values())
    settled = efficiency.measured and efficiency.measured_in == mode and efficiency.steps >= wait_steps
    if current.staleness > 0 and measuring and not settled:
        return None
    return throughput * current.efficiency


def open_trial(
    chosen: Candidate,
    decision: Decision,
    current: Prediction,
    view: JobView,
    progress: Progress,
    now: float,
    step: int,
    shape: str,
) -> Trial | None:
    """The trial of the change just made (None: a change that is not checked, or a left configuration
    without a measured, positive progress to compare with)."""
    if chosen.restoring or not isinstance(decision, SwitchMode | Rebalance):
        return None
    before = progress.tally
    if progress.since is None or before.windows < 1.0 or before.mean <= 0 or current.useful <= 0:
        return None
    predicted = chosen.prediction.useful
    if not math.isfinite(predicted) or predicted <= 0:
        return None
    mode = decision.mode if isinstance(decision, SwitchMode) else view.mode
    return Trial(
        key=chosen.key,
        label=chosen.prediction.label,
        mode=mode,
        predicted=predicted,
        gain=predicted / current.useful - 1.0,
        time=now,
        step=step,
        shape=shape,
        before=before,
        back_mode=view.mode,
        back_batches=tuple(view.batch(r) for r in range(view.world_size)),
        back_groups=view.groups if view.mode == SyncMode.HIERARCHICAL.value else None,
        speeds=progress.speeds,
    )


# A speed read twice agrees within this many of its standard errors (2 sigmas of a difference of
# two readings, sqrt 2 times one's); the same significance a re-split's gain needs (RESPLIT_SIGMAS).
_AGREE = RESPLIT_SIGMAS * math.sqrt(2.0)


def fleet_drift(
    trial: Trial | None, speeds: Mapping[int, float], errors: Mapping[int, float | None], view: JobView
) -> float:
    """How much faster (+) or slower (-) the fleet runs the job's step now than when the left
    configuration's tally began, beyond what the change of each rank's batch explains (0.0 where it
    cannot be read). Per sample, a rank whose batch grew can only have got faster (its fixed part
    of a step spread over more samples), by at most the batch's growth; one whose batch shrank
    slower by at most as much; one with the same batch neither. A speed outside those bounds (by more
    than its measured error allows) moved with the fleet; the ranks' moves are read by sync's step
    model (the slowest rank's step sets the job's)."""
    world = view.world_size
    if trial is None or len(trial.speeds) != world or len(trial.back_batches) != world:
        return 0.0
    expected: dict[int, float] = {}
    for r, before in enumerate(trial.speeds):
        now, b0, b1 = speeds.get(r, 0.0), trial.back_batches[r], view.batch(r)
        if before <= 0 or now <= 0 or b0 <= 0 or b1 <= 0:
            return 0.0
        tolerance = _AGREE * (errors.get(r) or 0.0)
        low = before * min(1.0, b1 / b0) * (1.0 - tolerance)
        high = before * max(1.0, b1 / b0) * (1.0 + tolerance)
        expected[r] = min(high, max(low, now))
    step_now = max(view.batch(r) / speeds[r] for r in expected)
    step_expected = max(view.batch(r) / expected[r] for r in expected)
    return step_expected / step_now - 1.0


def judge(
    trial: Trial | None,
    progress: Progress,
    shape: str,
    now: float,
    horizon: float,
    view: JobView,
    step: int,
    drift: float = 0.0,
) -> Verdict:
    """The trial's verdict after this window (module doc): the significance a re-split's gain needs
    (RESPLIT_SIGMAS standard errors), on at least the windows a re-split's speeds need (RESPLIT_WINDOWS:
    a window's noise is shared by its steps, and a second window halves its variance). `drift`: how
    far the fleet moved meanwhile (`fleet_drift`); the verdict must hold with it taken out too."""
    if trial is None or trial.shape != shape or trial.mode != view.mode or len(trial.back_batches) != view.world_size:
        return Verdict(Outcome.VOID)
    if trial.before.mean <= 0:
        return Verdict(Outcome.VOID)
    expired = now - trial.time > horizon
    before, after = trial.before, progress.tally
    error = pooled_error(before, after)
    freedom = before.windows + after.windows - 2.0
    # A speed's measured error needs MIN_SPREAD_WINDOWS windows around one mean; two means, one more.
    # Windows that all read the same (a step count too coarse to show the noise) measure no error.
    enough = progress.since is not None and after.windows >= RESPLIT_WINDOWS and freedom >= MIN_SPREAD_WINDOWS - 1
    if not enough or error is None or error <= 0:
        return Verdict(Outcome.VOID if expired else Outcome.WAIT)
    diff = after.mean - before.mean
    measured, relative = diff / before.mean, error / before.mean
    # A left configuration that made next to nothing: no comparison. (x 100: a gain is printed as a
    # percentage, and one over a denormal rate overflows there though finite here.)
    if not (math.isfinite(measured * 100) and math.isfinite(relative * 100)):
        return Verdict(Outcome.VOID)
    if abs(drift) > max(trial.gain, 0.0):
        return Verdict(Outcome.VOID)  # the fleet moved more than the change was to gain
    ratio = min(1.0, max(0.0, after.mean / trial.predicted))
    verdict = Verdict(Outcome.WAIT, measured, relative, ratio, max(0, step - trial.step), after.mean)
    # What the change measured with the fleet's move taken out, on the same significance.
    still = after.mean / (1.0 + drift) - before.mean
    if max(diff, still) < -RESPLIT_SIGMAS * error:
        return replace(verdict, outcome=Outcome.REVERT)
    if min(diff, still) > RESPLIT_SIGMAS * error:
        return replace(verdict, outcome=Outcome.KEPT)
    return replace(verdict, outcome=Outcome.VOID if expired else Outcome.WAIT)


def splits_back(trial: Trial, view: JobView) -> bool:
    """Going back is a new split of sync's batch (else a mode switch)."""
    return trial.back_mode == view.mode == SyncMode.SYNC.value


def may_revert(trial: Trial, view: JobView) -> bool:
    """The spec still allows going back (a user may have fixed the mode or narrowed allowedActions
    since the change was made)."""
    if splits_back(trial, view):
        return view.allows(Action.REBALANCE)
    return view.auto and view.allows(Action.SWITCH_MODE)


def revert(trial: Trial, verdict: Verdict, view: JobView, summary: str, span: float) -> SwitchMode | Rebalance:
    """The decision that takes `trial`'s change back to the configuration it left, with a reason that
    says what was predicted and what was measured."""
    sizes = dict(enumerate(trial.back_batches))
    unequal = any(b != view.base_batch for b in trial.back_batches)
    unequal_now = any(view.batch(r) != view.base_batch for r in range(view.world_size))
    if splits_back(trial, view):
        back = "the previous split of sync's batch"
    else:
        back = trial.back_mode + (" with the batch split it had" if unequal else "")
    why = (
        f"{summary}; {trial.label} predicted {gain_text(trial.gain)}, measured {gain_text(verdict.measured)} "
        f"({_error_text(verdict.error)}) after {verdict.steps} steps: {verdict.useful:.4g} useful samples/s vs "
        f"{trial.before.mean:.4g} before the change; back to {back} without waiting for the cooldown; "
        f"{trial.label} counts at {verdict.ratio:.0%} of its prediction on this fleet for {span:.0f}s"
    )
    # What going back is expected to gain: the left configuration's measured progress over the new
    # one's (0 where the new one made none: no finite figure, the reason says why).
    gain = round(1.0 / (1.0 + verdict.measured) - 1.0, 4) if verdict.measured > -1.0 else 0.0
    if splits_back(trial, view):
        return Rebalance(sizes, why, gain)
    return SwitchMode(trial.back_mode, why, trial.back_groups, sizes if unequal or unequal_now else None, gain)


def _error_text(error: float) -> str:
    """'±1.3%', or '±<0.1%' for a smaller one (it is never exactly 0: `judge` needs a measured spread)."""
    if not math.isfinite(error * 100):
        return "error too large to print"
    return f"±{error:.1%}" if error >= 0.0005 else "±<0.1%"


def remember(
    discounts: Sequence[Discount], trial: Trial, ratio: float, now: float, horizon: float
) -> tuple[Discount, ...]:
    """`discounts` with `trial`'s change taken back: one horizon, doubled for each time it was taken
    back while its last discount was still remembered (`prune`)."""
    same = [d for d in discounts if d.key == trial.key and d.shape == trial.shape]
    count = same[-1].count + 1 if same else 1
    others = tuple(d for d in discounts if d not in same)
    span = discount_span(horizon, count)
    return (*others, Discount(trial.key, trial.shape, ratio, now, now + span, count))


def discount_span(horizon: float, count: int) -> float:
    return horizon * 2.0 ** min(count - 1, MAX_DOUBLINGS)


def prune(discounts: Sequence[Discount], now: float) -> tuple[Discount, ...]:
    """The discounts still remembered: one is forgotten as long after it ended as it lasted, so a
    change taken back again soon after its discount ended is discounted for twice as long."""
    return tuple(d for d in discounts if now < d.until + (d.until - d.since))


def discounted(
    candidates: Sequence[Candidate], discounts: Sequence[Discount], shape: str, now: float
) -> list[Candidate]:
    """The candidates with each one taken back on this fleet shape counted at what it delivered."""
    ratios = {d.key: d.ratio for d in discounts if d.active(shape, now)}
    return [
        c
        if c.key not in ratios
        else replace(c, prediction=replace(c.prediction, efficiency=c.prediction.efficiency * ratios[c.key]))
        for c in candidates
    ]


def discount_note(discounts: Sequence[Discount], shape: str, now: float) -> str:
    """'; switch:hierarchical counts at 28% of its prediction for 240s more (taken back)', for each
    discount in force, so a reason says why a change it would otherwise make is not made."""
    return "".join(
        f"; {d.key} counts at {d.ratio:.0%} of its prediction for {d.until - now:.0f}s more (taken back)"
        for d in discounts
        if d.active(shape, now)
    )
