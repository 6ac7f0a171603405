"""`evaluate`: one policy step from samples to a decision, with every rule that keeps it calm.

A change is made only when (1) the cost model predicts at least switchMargin more useful
throughput than the job gets now (or, for the way back to plain sync, no loss; for a new split of
sync's batch, `split_margin` once every speed rests on RESPLIT_STEPS steps), (2) the same change
has been the best for persistenceIntervals windows in a row (a new split of sync's batch with a
very large gain at once, FAST_GAIN), (3) cooldownSeconds have passed since
the last change (not for the way back to plain sync, nor for a new split of sync's batch; growing
back to the goal replicas waits, see `candidates`), and (4) the change pays back its own cost
(restart or switch pause) well within the time it will stay in force, and before the job's last
step when the step is known (the way back to plain sync: its pause ends before the job does),
(5) no change is still in flight (`JobView.in_flight`), and (6) a configuration with stale
gradients waits for the measured statistical efficiency (MEASURE_WAIT_STEPS). A hang
(`policy.hang`) is recovered from at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sgdjob_operator.policy.candidates import Candidate, DecisionContext, build, predict_current, straggler_node
from sgdjob_operator.policy.cost import CostInputs, Prediction
from sgdjob_operator.policy.decisions import Decision, Keep, ReplaceWorker, Rescale
from sgdjob_operator.policy.efficiency import MIN_STEPS, estimate
from sgdjob_operator.policy.hang import find_hang
from sgdjob_operator.policy.health import JobHealth, Shape, assess, jitter_coefficient
from sgdjob_operator.policy.job import JobView
from sgdjob_operator.policy.measure import FirstWindow, Window, measure
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.state import PolicyState, RankState
from sgdjob_operator.policy.stats import median
from sgdjob_trainer.config import SyncMode

# A candidate within this fraction of the best is as good as the best: the one already persisting
# wins, so two near-equal options cannot take turns and reset each other's persistence. (The
# shape's favourite, see candidates.Candidate.preference, goes first.)
PREFERENCE_SLACK = 0.03
# A configuration with stale gradients must predict this much more than the best fresh one (sync,
# rebalanced, resized): its worth rests on the measured gradient correlation, whose estimation error
# the fresh one does not carry.
# Set on the tuning set: --quick (homogeneous, one-straggler), digits-mlp, interval 2 s, seed 0 (ca8b1bb).
STALENESS_SLACK = 0.05
# A configuration with stale gradients (async, hierarchical) is worth what the measured gradient
# correlation says. Until it has been averaged over this many steps in the current mode, only fresh
# changes are made: a fast policy interval would otherwise decide on the stalenessPenalty prior, or
# on the first steps' correlation, which is near 1 while the loss falls steeply and then drops
# (digits-mlp went hierarchical on 1.000 over 19 steps and lost a third of its goodput). Trainers that
# never measure get the prior once their processes have made this many steps.
# Fitted on the tuning set (bench/README.md): bimodal, digits-cnn, interval 1 s, seeds 0-2 (0e28b58).
MEASURE_WAIT_STEPS = 3 * MIN_STEPS
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
# A change must pay for its own pause (a restart costs a minute or more) within this many policy
# intervals, or the cooldown if longer: long enough for a replacement to be worth it, short enough
# that a marginal gain never justifies a restart.
PAYBACK_INTERVALS = 30


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The decision, the health it was based on, the state to keep for next time, and the cost
    model's predictions (useful samples/s by label, `current` included) for logs and reports.
    `held` is the change the policy would have made had none been in flight."""

    decision: Decision
    health: JobHealth
    state: PolicyState
    predictions: Mapping[str, float]
    held: Decision | None = None


def evaluate(state: PolicyState, samples: Sequence[WorkerSample], job: JobView, now: float) -> Evaluation:
    """Evaluate one policy interval. Pure: `now` and the samples' times are the only clock."""
    p = job.policy
    window = measure(state.ranks, samples, job.world_size, FirstWindow.for_interval(p.interval_seconds))
    a = assess(window, state, p)
    comm = (
        job.comm
        if job.comm.gradient_bytes or not window.gradient_bytes
        else job.comm.with_gradient_bytes(window.gradient_bytes)
    )
    jitter = jitter_coefficient(window, comm, state.jitter)
    base = PolicyState(
        ranks=a.ranks,
        heterogeneous=a.heterogeneous,
        shape=a.shape_key,
        shape_streak=a.shape_streak,
        candidate=None,
        candidate_streak=0,
        last_change=state.last_change,
        jitter=jitter,
        evaluations=state.evaluations + 1,
    )
    health = a.health
    hang = find_hang(window.latest, job.world_size, p.hang_timeout_seconds)
    # A recovery already under way gets the hang timeout to show progress before another one.
    recovering = state.last_change is not None and now - state.last_change < (p.hang_timeout_seconds or 0.0)
    if hang is not None and not recovering:
        recover = ReplaceWorker(hang.rank, hang.reason(p.hang_timeout_seconds or 0.0), hang.pod, hung=True)
        return Evaluation(recover, health, replace(base, last_change=now), {})
    if health.raw_shape is Shape.UNKNOWN:
        why = f"waiting for rates: {health.measured} of {job.world_size} ranks measured this window"
        if window.restarted:
            why += f" ({len(window.restarted)} restarted)"
        return Evaluation(Keep(why), health, base, {})

    speeds = _world_speeds(health, job.world_size)
    nodes = {r: (a.ranks[r].node if r in a.ranks else None) for r in speeds}
    pods = {r: (window.latest[r].pod if r in window.latest else None) for r in speeds}
    stale = [w.staleness for w in window.ranks.values() if w.mode == "async"]
    efficiency = estimate(
        window.latest.values(), p.staleness_penalty, job.staleness_lr, job.planned_batch, job.lr_scaling
    )
    ci = CostInputs(
        comm,
        jitter,
        efficiency,
        job.average_every,
        job.hier_staleness,
        job.async_staleness,
        job.ps_shards,
    )
    async_ok = all(s.async_capable is not False for s in window.latest.values())
    fixed = {r: v for r, v in health.fixed_seconds().items() if r in speeds}
    measured_stale = sum(stale) / len(stale) if stale else None
    ctx = DecisionContext(health, job, speeds, nodes, pods, ci, measured_stale, async_ok, fixed)
    current = predict_current(ctx)
    candidates = build(ctx)
    predictions = {"current": current.useful, **{c.prediction.label: c.prediction.useful for c in candidates}}
    left = seconds_left(window, job)
    trained = min((s.steps for s in window.latest.values()), default=0)
    waiting_for = ""
    evidence = efficiency.steps if efficiency.measured else trained
    every = candidates
    if evidence < MEASURE_WAIT_STEPS:
        fresh = [c for c in candidates if c.prediction.staleness == 0]
        if len(fresh) < len(candidates):
            waiting_for = (
                f"; stale modes wait for {MEASURE_WAIT_STEPS} steps of measured gradient statistics ({evidence} so far)"
            )
        candidates = fresh
    split = split_margin(health, job.world_size)
    chosen = _choose(candidates, current, job, state.candidate, left, split)
    if chosen is None:
        why = _keep_reason(health, current, candidates, job, left, bool(waiting_for), split) + waiting_for
        return Evaluation(Keep(why), health, base, predictions)

    streak = state.candidate_streak + 1 if chosen.key == state.candidate else 1
    waiting = replace(base, candidate=chosen.key, candidate_streak=streak)
    gain = _gain(chosen.prediction, current)
    basis = ""
    if chosen.batch_only and split is not None:
        basis = f"; speeds over {RESPLIT_STEPS}+ steps at each rank's batch (margin {_percent(split)})"
    if fixed and chosen.prediction.staleness == 0:
        fits = ", ".join(f"rank {r} {v * 1000:.1f} ms" for r, v in sorted(fixed.items()))
        basis += f"; fixed step time fitted from two batch sizes: {fits}"
    what = (
        f"{chosen.prediction.label} predicts {chosen.prediction.useful:.4g} useful samples/s "
        f"vs {current.useful:.4g} now ({gain_text(gain)}){basis}; {efficiency.describe()}{waiting_for}"
    )
    if job.in_flight:
        # Persistence starts over once the change has landed: no cooldown starts, no streak grows.
        held = chosen.make(f"{health.summary}; {what}", round(gain, 4))
        return Evaluation(Keep(f"{health.summary}; {what}; held: {job.in_flight}"), health, base, predictions, held)
    if streak < p.persistence_intervals or health.shape is Shape.TRANSIENT:
        if not _fast(chosen, gain, health, job.world_size, every, p.switch_margin, state.ranks):
            why = f"{health.summary}; {what}; persisting {streak}/{p.persistence_intervals} intervals"
            return Evaluation(Keep(why), health, waiting, predictions)
        what += f"; made at once: a new split gaining +{FAST_GAIN:.0%} or more does not wait out persistence"
    # The way back to plain sync is exempt: it is where an equal fleet rests, it has persisted like any
    # change, and unequal batches or a stale mode kept through a cooldown after the straggler has gone
    # only cost time (a transient or intermittent straggler would otherwise outlive itself). So is a
    # new split of sync's batch: it pauses nothing, and a straggler that comes back soon after it went
    # would otherwise run a whole cooldown at equal batches (measured: 1.2x the best static system on
    # digits-cnn). It still starts the cooldown, so a mode switch or restart after it waits.
    cooled = (not chosen.restoring or chosen.settle) and not chosen.batch_only
    if cooled and state.last_change is not None and now - state.last_change < p.cooldown_seconds:
        left = p.cooldown_seconds - (now - state.last_change)
        return Evaluation(Keep(f"{health.summary}; {what}; cooldown {left:.0f}s left"), health, waiting, predictions)
    decision = chosen.make(f"{health.summary}; {what}", round(gain, 4))
    changed = replace(base, last_change=now, ranks=_forget_replaced(a.ranks, decision, ctx))
    return Evaluation(decision, health, changed, predictions)


def _fast(
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


def _world_speeds(health: JobHealth, world: int) -> dict[int, float]:
    """Every rank's speed for the cost model: its last known one, else the median (a missing or
    new rank is assumed typical: the policy never acts on a rank it has not measured)."""
    known = health.speeds()
    typical = median(list(known.values())) if known else 1.0
    return {r: known.get(r, typical) for r in range(world)}


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


def margin(c: Candidate, job: JobView, split: float | None) -> float:
    """The predicted gain `c` needs: switchMargin, or, for a new split of sync's batch once the speeds
    are settled, `split` (`split_margin`) if smaller."""
    if c.batch_only and split is not None:
        return min(job.policy.switch_margin, split)
    return job.policy.switch_margin


def _percent(x: float) -> str:
    """+10%, +1.5%: a margin to the precision it was set at."""
    return f"{x:+.0%}" if round(x * 100, 1) == round(x * 100) else f"{x:+.1%}"


def gain_text(gain: float) -> str:
    """A predicted gain as a reason prints it: '+51%', or words where the current configuration
    makes no measured useful progress (a gain over nothing is no percentage: never '+inf%' or 'nan%')."""
    if math.isnan(gain):
        return "gain unknown"
    if math.isinf(gain):
        return "no useful progress measured now"
    return f"{gain:+.0%}"


def _gain(pred: Prediction, current: Prediction) -> float:
    if current.useful <= 0:
        return float("inf") if pred.useful > 0 else 0.0
    return pred.useful / current.useful - 1.0


def seconds_left(window: Window, job: JobView) -> float | None:
    """Seconds until the job's last step at this window's pace (None: the step or the pace is not
    known). The job's step is rank 0's in sync and hierarchical (every rank steps once per job step)
    and the parameter server's in async (every rank's push is a step)."""
    rates = [r.steps / r.seconds for r in window.ranks.values() if r.seconds > 0]
    if job.steps_left is None or not rates:
        return None
    pace = sum(rates) if job.mode == SyncMode.ASYNC.value else max(rates)
    return job.steps_left / pace


def _horizon(job: JobView, left: float | None) -> float:
    horizon = max(job.policy.cooldown_seconds, PAYBACK_INTERVALS * job.policy.interval_seconds)
    return horizon if left is None else min(horizon, left)


def _viable(c: Candidate, current: Prediction, job: JobView, left: float | None, split: float | None) -> bool:
    if c.restoring:
        return c.prediction.useful >= current.useful and (left is None or c.cost_seconds < left)
    gain = _gain(c.prediction, current)
    if gain < margin(c, job, split):
        return False
    horizon = _horizon(job, left)
    payback = c.cost_seconds * current.useful / (c.prediction.useful - current.useful)
    return payback <= horizon


def _choose(
    candidates: list[Candidate],
    current: Prediction,
    job: JobView,
    previous: str | None,
    left: float | None,
    split: float | None = None,
) -> Candidate | None:
    viable = [c for c in candidates if _viable(c, current, job, left, split)]
    if not viable:
        return None
    best = max(viable, key=lambda c: c.prediction.useful)
    favourites = [
        c for c in viable if c.preference > 0 and c.prediction.useful >= best.prediction.useful * (1 - c.preference)
    ]
    if favourites:
        return max(favourites, key=lambda c: c.preference)
    if best.prediction.staleness > 0:
        fresh = [c for c in viable if c.prediction.staleness == 0]
        top = max(fresh, key=lambda c: c.prediction.useful, default=None)
        if top is not None and top.prediction.useful >= best.prediction.useful * (1 - STALENESS_SLACK):
            best = top
    for c in viable:
        if c.key == previous and c.prediction.useful >= best.prediction.useful * (1 - PREFERENCE_SLACK):
            return c
    return best


def _keep_reason(
    health: JobHealth,
    current: Prediction,
    candidates: list[Candidate],
    job: JobView,
    left: float | None,
    stale_waiting: bool = False,
    split: float | None = None,
) -> str:
    ending = ""
    if left is not None and left < _horizon(job, None):
        ending = f"; the job ends in about {left:.0f}s ({job.steps_left} steps)"
    gainful = [c for c in candidates if _gain(c.prediction, current) >= margin(c, job, split)]
    if health.shape is Shape.HOMOGENEOUS and not (ending and gainful):
        return f"{health.summary}; nothing to change"
    if not candidates and stale_waiting:
        return f"{health.summary}; every allowed change has stale gradients"
    if not candidates:
        return (
            f"{health.summary}; no allowed action applies "
            f"(allowedActions: {', '.join(a.value for a in job.policy.allowed_actions) or 'none'})"
        )
    best = max(candidates, key=lambda c: c.prediction.useful)
    gain = gain_text(_gain(best.prediction, current))
    return (
        f"{health.summary}; best alternative {best.prediction.label} predicts {gain} "
        f"(a change needs {_percent(margin(best, job, split))} and must repay its pause{ending})"
    )


def _forget_replaced(ranks: Mapping[int, RankState], decision: Decision, ctx: DecisionContext) -> dict[int, RankState]:
    """Ranks whose pod goes away start over: a new pod's speed and streak are its own."""
    out = dict(ranks)
    if isinstance(decision, ReplaceWorker | Rescale):
        found = straggler_node(ctx)
        gone = set(found[1]) if found else set()
        if isinstance(decision, Rescale):
            gone |= set(decision.remove_ranks)
        for r in gone:
            if r in out:
                out[r] = replace(out[r], speed=None, streak=0, flagged=False)
    return out
