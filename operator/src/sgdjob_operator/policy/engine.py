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
(5) no change is still in flight (`JobView.in_flight`), (6) a configuration with stale
gradients waits for the measured statistical efficiency (MEASURE_WAIT_STEPS), and (7) a change of
the kind still under check is not made again while that check's windows so far show less than
switchMargin of gain (`evidence.unproven_repeat`). A hang
(`policy.hang`) is recovered from at once, and so is a change its own results show under-delivering
(`policy.check`): it is taken back without waiting for persistence or the cooldown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sgdjob_operator.policy.candidates import (
    Candidate,
    DecisionContext,
    build,
    predict_current,
    removal_gate_note,
    straggler_node,
)
from sgdjob_operator.policy.check import (
    Outcome,
    discount_note,
    discounted,
    fleet_drift,
    gain_text,
    judge,
    may_revert,
    open_trial,
    prune,
    remember,
    revert,
    splits_back,
    window_starts,
    window_useful,
)
from sgdjob_operator.policy.cost import CostInputs, Prediction
from sgdjob_operator.policy.decisions import Decision, Keep, ReplaceWorker, Rescale
from sgdjob_operator.policy.efficiency import MIN_STEPS, Efficiency, estimate
from sgdjob_operator.policy.evidence import removal_persisted, transient_for, unproven_repeat
from sgdjob_operator.policy.hang import find_hang
from sgdjob_operator.policy.health import Assessment, JobHealth, Shape, assess, jitter_coefficient
from sgdjob_operator.policy.job import JobView
from sgdjob_operator.policy.measure import FirstWindow, Window, measure
from sgdjob_operator.policy.progress import restarted, track
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.splits import (
    FAST_GAIN,
    RESPLIT_STEPS,
    SplitMargins,
    fast,
    margin,
    margin_text,
    speed_noise,
    split_margin,
)
from sgdjob_operator.policy.state import PolicyState, RankState
from sgdjob_operator.policy.stats import median
from sgdjob_operator.policy.trial import Trial
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
        settled=settled_shape(a, state, p.persistence_intervals),
        candidate=None,
        candidate_streak=0,
        last_change=state.last_change,
        last_pause=state.last_pause,
        jitter=jitter,
        evaluations=state.evaluations + 1,
        progress=state.progress,
        trial=state.trial,
        discounts=prune(state.discounts, now),
    )
    health = a.health
    hang = find_hang(window.latest, job.world_size, p.hang_timeout_seconds)
    # A recovery already under way gets the hang timeout to show progress before another one.
    recovering = state.last_change is not None and now - state.last_change < (p.hang_timeout_seconds or 0.0)
    if hang is not None and not recovering:
        recover = ReplaceWorker(hang.rank, hang.reason(p.hang_timeout_seconds or 0.0), hang.pod, hung=True)
        recovered = replace(base, last_change=now, last_pause=now, progress=restarted(), trial=None)
        return Evaluation(recover, health, recovered, {})
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
    hierarchical_ok = all(s.hierarchical_capable is not False for s in window.latest.values())
    fixed = {r: v for r, v in health.fixed_seconds().items() if r in speeds}
    measured_stale = sum(stale) / len(stale) if stale else None
    ctx = DecisionContext(health, job, speeds, nodes, pods, ci, measured_stale, async_ok, fixed, hierarchical_ok)
    current = predict_current(ctx)
    useful = window_useful(window, health.throughput, current, efficiency, job.mode, MEASURE_WAIT_STEPS)
    new_shape = base.settled != state.settled
    scraped = min((s.time for s in window.latest.values()), default=now)
    progress = track(
        state.progress,
        scraped,
        window_starts(window),
        job.world_size,
        useful,
        bool(job.in_flight),
        new_shape,
        [speeds[r] for r in range(job.world_size)],
    )
    horizon = _horizon(job, None)
    trial = state.trial
    drift = fleet_drift(trial, speeds, {r: h.error for r, h in health.ranks.items()}, job)
    verdict = judge(trial, progress, base.settled, now, horizon, job, health.step, drift)
    base = replace(base, progress=progress, trial=trial if verdict.outcome is Outcome.WAIT else None)
    candidates = discounted(build(ctx), base.discounts, base.settled, now)
    note = discount_note(base.discounts, base.settled, now) + removal_gate_note(ctx)
    predictions = {"current": current.useful, **{c.prediction.label: c.prediction.useful for c in candidates}}
    left = seconds_left(window, job)
    if verdict.outcome is Outcome.REVERT and trial is not None:
        cost = job.rebalance_seconds if splits_back(trial, job) else job.switch_seconds
        if job.in_flight:
            base = replace(base, trial=trial)  # judged again once the change in flight has landed
        elif may_revert(trial, job) and (left is None or cost < left):  # else the check closes unheeded
            kept = remember(base.discounts, trial, verdict.ratio, now, horizon)
            back = revert(trial, verdict, job, health.summary, kept[-1].until - now)
            paused = base.last_pause if splits_back(trial, job) else now
            after = replace(base, last_change=now, last_pause=paused, progress=restarted(), trial=None, discounts=kept)
            return Evaluation(back, health, after, predictions)
    candidates, unproven = unproven_repeat(candidates, base.trial, progress, p.switch_margin)
    note += unproven
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
    # While the last change's check has no verdict, a new split is no correction of it: the check
    # could not tell the two apart, and under noise one correction follows another at the re-split
    # margin (three at +3-5 % under 3 % noise). It then needs switchMargin, as any change.
    pending = base.trial
    settled = split_margin(health, job.world_size)
    split = SplitMargins(settled if pending is None else None, speed_noise(health, job.world_size))
    chosen = _choose(candidates, current, job, state.candidate, left, split)
    if chosen is None:
        why = _keep_reason(health, current, candidates, job, left, bool(waiting_for), split, pending)
        why += waiting_for + note
        return Evaluation(Keep(why), health, base, predictions)

    streak = state.candidate_streak + 1 if chosen.key == state.candidate else 1
    waiting = replace(base, candidate=chosen.key, candidate_streak=streak)
    gain = _gain(chosen.prediction, current)
    basis = ""
    if chosen.batch_only and not chosen.restoring and settled is not None:
        basis = f"; speeds over {RESPLIT_STEPS}+ steps at each rank's batch (margin {margin_text(chosen, job, split)})"
    if fixed and chosen.prediction.staleness == 0:
        fits = ", ".join(f"rank {r} {v * 1000:.1f} ms" for r, v in sorted(fixed.items()))
        basis += f"; fixed step time fitted from two batch sizes: {fits}"
    what = (
        f"{chosen.prediction.label} predicts {chosen.prediction.useful:.4g} useful samples/s "
        f"vs {current.useful:.4g} now ({gain_text(gain)}){basis}; {efficiency.describe()}{waiting_for}{note}"
    )
    if job.in_flight:
        # Persistence starts over once the change has landed: no cooldown starts, no streak grows.
        held = chosen.make(f"{health.summary}; {what}", round(gain, 4))
        return Evaluation(Keep(f"{health.summary}; {what}; held: {job.in_flight}"), health, base, predictions, held)
    persisted = streak >= p.persistence_intervals or removal_persisted(chosen, health)
    leave = worthless(current, efficiency, job) and chosen.prediction.staleness == 0 and not chosen.restarts
    if leave:
        what += (
            f"; made at once: {job.mode} measured its updates worth nothing over "
            f"{efficiency.steps} steps in it, and neither persistence nor the cooldown holds a way out of it"
        )
    elif not persisted or transient_for(chosen, health):
        if not fast(chosen, gain, health, job.world_size, every, p.switch_margin, state.ranks):
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
    # A restart's cooldown runs from the last change that paused training: a new split of sync's batch
    # before it is no flap to wait out (it paused nothing, and the restart is weighed by its own pause
    # and persistence). Measured on real nodes: a split at step 8 held the rescale that the split's
    # own results called for until step 127-199 (the 10-s cooldown), 2x DDP-without-the-node's time.
    since = state.last_pause if chosen.restarts else state.last_change
    if cooled and not leave and since is not None and now - since < p.cooldown_seconds:
        left = p.cooldown_seconds - (now - since)
        return Evaluation(Keep(f"{health.summary}; {what}; cooldown {left:.0f}s left"), health, waiting, predictions)
    decision = chosen.make(f"{health.summary}; {what}", round(gain, 4))
    # The change is checked by its results against what the configuration it leaves measured.
    opened = open_trial(chosen, decision, current, job, progress, now, health.step, base.settled)
    changed = replace(
        base,
        last_change=now,
        last_pause=state.last_pause if chosen.batch_only else now,
        ranks=_forget_replaced(a.ranks, decision, ctx),
        progress=restarted(),
        trial=opened,
    )
    if leave and base.trial is not None and base.trial.mode == job.mode:
        # Left as a check would take it back: not made again on the same prediction for a horizon.
        changed = replace(changed, discounts=remember(base.discounts, base.trial, 0.0, now, horizon))
    return Evaluation(decision, health, changed, predictions)


def worthless(current: Prediction, efficiency: Efficiency, job: JobView) -> bool:
    """The configuration in force is a stale mode whose own gradient statistics, over the steps a
    stale mode's measurement needs (MEASURE_WAIT_STEPS), say its updates are worth nothing (the
    correlation of consecutive gradients measured at 0 or below). A fresh configuration is then left
    at once: on a real node bound by its CPU quota a job went async on a correlation of 0.66 measured
    in sync, measured async's worth at 0, and stayed 10 s (its cooldown) while its check, on a fleet
    whose name kept changing, reached no verdict. Only hierarchical's synchronous group steps can
    measure that now: an async worker's lags that do not stand above the samples' noise read as
    unknown (sgdjob_trainer.gradient_stats), so async is left on its measured progress instead."""
    return (
        current.staleness > 0
        and current.useful <= 0
        and efficiency.measured
        and efficiency.measured_in == job.mode
        and efficiency.steps >= MEASURE_WAIT_STEPS
    )


def settled_shape(a: Assessment, state: PolicyState, persistence: int) -> str:
    """The fleet's signature once it has held for `persistence` windows, else the last one that did
    (the first known one before any has). A change's check, its discount and the progress it is
    measured by belong to a fleet, and a signature that flickers with the noise is no new fleet: on
    real nodes of equal 0.6-CPU quotas the name changed nearly every 0.5-s window (homogeneous,
    single straggler, 2 or 3 speed clusters, a different rank each time), every tally started over
    and no check ever reached a verdict; a job that went async there and then measured async's
    worth at 0 stayed 12 s, until the cooldown ended."""
    if a.health.raw_shape is Shape.UNKNOWN:
        return state.settled
    if not state.settled or a.shape_streak >= persistence:
        return a.shape_key
    return state.settled


def _world_speeds(health: JobHealth, world: int) -> dict[int, float]:
    """Every rank's speed for the cost model: its last known one, else the median (a missing or
    new rank is assumed typical: the policy never acts on a rank it has not measured)."""
    known = health.speeds()
    typical = median(list(known.values())) if known else 1.0
    return {r: known.get(r, typical) for r in range(world)}


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


def _viable(c: Candidate, current: Prediction, job: JobView, left: float | None, split: SplitMargins) -> bool:
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
    split: SplitMargins,
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
    split: SplitMargins | None = None,
    pending: Trial | None = None,
) -> str:
    ending = ""
    if left is not None and left < _horizon(job, None):
        ending = f"; the job ends in about {left:.0f}s ({job.steps_left} steps)"
    split = split or SplitMargins()
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
    checking = f" while the check of the last change ({pending.label}) has no verdict" if pending else ""
    return (
        f"{health.summary}; best alternative {best.prediction.label} predicts {gain} "
        f"(a change needs {margin_text(best, job, split)}{checking} and must repay its pause{ending})"
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
