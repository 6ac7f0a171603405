"""The changes worth considering for the fleet's shape, each with its predicted useful throughput.

A straggler's remedies within sync are two splits of the step: `rebalance` keeps the job's global
batch and hands the slow ranks' share to the fast ones; `trim` keeps the fast ranks' batch and gives
each slow rank what it finishes in their step, so the global batch shrinks (see `_trim` for when;
only where allowedActions lists trimBatch: over 10 seeds of the goodput benchmark's 3x straggler it
reached a sustained 0.9 accuracy later than the rebalanced split, not sooner, see bench/HISTORY.md).

Only actions in allowedActions are built; a job with a fixed mode gets no mode switch; a
homogeneous fleet gets only the way back: to plain sync, and to the replicas the job should run
(`_grow`), so measurement noise has nothing to act on.

Growing back (rescale allowed, the job runs fewer nodes than `JobView.goal`: after a shrink, or
after nodes were lost) is proposed only for a homogeneous fleet, i.e. with no straggler, and like
every change only with nothing in flight and after persistenceIntervals windows; unlike the way
back to plain sync it also waits for the cooldown, because it restarts the world. It cannot flap
with the shrink: a shrink needs a straggler (a grown fleet is measured anew, and its new ranks
must be slow for persistenceIntervals windows first), a shrink for a node-bound straggler keeps
the job off that node (`Rescale.exclude_node`, until policy.excludeNodeSeconds), and each of the
two waits out the cooldown after the other; so a node that stays slow costs at most one shrink
and one growth per excludeNodeSeconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sgdjob_operator.api.models import Action
from sgdjob_operator.policy.cost import (
    CostInputs,
    Prediction,
    StepTime,
    pooled,
    predict_async,
    predict_hierarchical,
    predict_sync,
    step_times,
)
from sgdjob_operator.policy.decisions import Decision, Rebalance, ReplaceWorker, Rescale, SwitchMode
from sgdjob_operator.policy.health import JobHealth, Shape
from sgdjob_operator.policy.job import JobView
from sgdjob_operator.policy.plans import (
    group_size_target,
    node_groups,
    paced_group_batches,
    rebalanced_batches,
    speed_groups,
    trimmed_batches,
)

# A decision factory: (reason, predicted gain) -> Decision.
Make = Callable[[str, float], Decision]


@dataclass(frozen=True, slots=True)
class DecisionContext:
    health: JobHealth
    view: JobView
    speeds: Mapping[int, float]
    nodes: Mapping[int, str | None]
    pods: Mapping[int, str | None]
    ci: CostInputs
    measured_staleness: float | None
    # False when some rank's optimizer keeps state async mode cannot shard: no async candidate.
    async_ok: bool = True
    # Seconds of a step that do not grow with the batch, for the ranks whose fit tells (speeds.py).
    fixed: Mapping[int, float] = field(default_factory=dict)
    # False when some rank cannot run hierarchical (a script on the adaptation API that cannot): no
    # hierarchical candidate.
    hierarchical_ok: bool = True

    def sync_steps(self) -> dict[int, StepTime]:
        """The ranks' step-time models at their measured speeds and current batches, for the sync
        predictions over the same ranks (proportional to the batch where no fixed part is known),
        each speed class at its mean (`cost.pooled`): the current split and every new one are
        judged by the same models, and a split gives ranks of one class the same batch."""
        own = step_times(self.speeds, {r: self.view.batch(r) for r in self.speeds}, self.fixed)
        return pooled(own, self.view.base_batch)


@dataclass(frozen=True, slots=True)
class Candidate:
    """`key` identifies the change across windows (persistence counts windows of the same key);
    `preference` is how far below the best prediction the shape's favourite may be and still be
    chosen; `restoring` marks the way back to plain sync, which needs no gain, only no loss;
    `batch_only` a new split of sync's batch, which the trainers apply at a step boundary without
    leaving sync (no restart, no mode switch)."""

    key: str
    make: Make
    prediction: Prediction
    cost_seconds: float
    preference: float = 0.0
    restoring: bool = False
    settle: bool = False  # a restoring change that still waits for the cooldown (it restarts the world)
    batch_only: bool = False
    restarts: bool = False  # a membership change: it restarts the world
    removes: tuple[int, ...] = ()  # the ranks a replacement or a shrink takes off


# Replacing a lone slow node wins over re-tuning around it unless it predicts clearly less: the
# alternatives keep paying for the bad node, and a rebalance's prediction profits from noise in
# the measured speeds that a replacement's (everyone at the typical speed) does not.
REPLACE_PREFERENCE = 0.10
# A trimmed split is proposed only when the noise scale values its smaller batch at least this much
# more per sample: below, the two splits differ by their rounding to whole samples (about 1 % of
# the step at 32 samples a rank), and the job's own global batch is kept.
TRIM_WORTH = 0.02
# Speed clusters lean to hierarchical only as a tie-break.
CLUSTER_PREFERENCE = 0.03


def current_groups(ctx: DecisionContext) -> list[list[int]]:
    view = ctx.view
    if view.groups:
        return [list(g) for g in view.groups]
    if view.group_by_node:
        return node_groups(ctx.nodes)
    return speed_groups(ctx.speeds, view.policy.recover_threshold, group_size_target(len(ctx.speeds)))


def predict_config(
    ctx: DecisionContext,
    mode: str,
    speeds: Mapping[int, float],
    batches: Mapping[int, int],
    groups: list[list[int]] | None,
    label: str,
    lr_ratio: float = 1.0,
) -> Prediction:
    if mode == "async":
        return predict_async(
            speeds, batches, ctx.ci, ctx.measured_staleness if ctx.view.mode == "async" else None, label
        )
    if mode == "hierarchical":
        return predict_hierarchical(speeds, batches, groups or current_groups(ctx), ctx.ci, label)
    # The step-time models hold for the measured speeds only (not for a replacement's assumed ones).
    steps = {r: st for r, st in ctx.sync_steps().items() if r in speeds and speeds[r] == ctx.speeds.get(r)}
    return predict_sync(speeds, batches, ctx.ci, label, lr_ratio, steps)


def predict_current(ctx: DecisionContext) -> Prediction:
    batches = {r: ctx.view.batch(r) for r in ctx.speeds}
    return predict_config(ctx, ctx.view.mode, ctx.speeds, batches, None, "current")


def build(ctx: DecisionContext) -> list[Candidate]:
    view, shape = ctx.view, ctx.health.raw_shape
    if shape is Shape.UNKNOWN:
        return []
    plain = {r: view.base_batch for r in ctx.speeds}
    unequal = any(view.batch(r) != view.base_batch for r in ctx.speeds)
    switch = view.auto and view.allows(Action.SWITCH_MODE)
    steps = ctx.sync_steps()
    out: list[Candidate] = []
    if shape is Shape.HOMOGENEOUS:
        # An equal fleet runs plain sync at its median speed: a rank measured at a smaller batch than
        # the job's (a straggler's share, kept after it recovered) reads slower per sample than it
        # would at the job's batch (a step's fixed part weighs more), and read as such it would hold
        # the way back to plain sync up for as long as its small batch lasts.
        even = {r: ctx.health.median_speed for r in ctx.speeds} if ctx.health.median_speed > 0 else ctx.speeds
        if view.mode == "sync" and unequal and view.allows(Action.REBALANCE):
            out.append(
                _candidate(
                    "plain",
                    lambda why, g: Rebalance(plain, why, g),
                    predict_sync(even, plain, ctx.ci, "plain sync"),
                    view.rebalance_seconds,
                    restoring=True,
                    batch_only=True,
                )
            )
        elif view.mode != "sync" and switch:
            back = plain if unequal else None
            pred = predict_sync(even, plain, ctx.ci, "plain sync")
            out.append(
                _candidate(
                    "switch:sync",
                    lambda why, g: SwitchMode("sync", why, None, back, g),
                    pred,
                    view.switch_seconds,
                    restoring=True,
                )
            )
        return out + _grow(ctx)
    if shape in (Shape.SINGLE_STRAGGLER, Shape.CLUSTERS, Shape.DISPERSED):
        # Not only a single straggler: a rebalance that cut the slow node's batch can make the fast
        # ranks read apart (a step's fixed part, a CPU quota's bursts), and the fleet then reads as
        # clusters while the remedy a user would try by hand, dropping the slow node, still exists.
        out.extend(_membership(ctx))
    total = view.base_batch * len(ctx.speeds)
    caps = {r: view.cap(r) for r in ctx.speeds}
    if view.allows(Action.REBALANCE) and (view.mode == "sync" or switch):
        rates = {r: st.rate for r, st in steps.items()}
        b = rebalanced_batches(rates, total, caps, {r: st.fixed for r, st in steps.items()})
        pred = predict_sync(ctx.speeds, b, ctx.ci, "rebalanced sync", steps=steps)
        make: Make = (
            (lambda why, g: Rebalance(b, why, g))
            if view.mode == "sync"
            else (lambda why, g: SwitchMode("sync", why, None, b, g))
        )
        in_sync = view.mode == "sync"
        cost = view.rebalance_seconds if in_sync else view.switch_seconds
        out.append(_candidate("rebalance", make, pred, cost, batch_only=in_sync))
        if view.allows(Action.TRIM_BATCH):
            out.extend(_trim(ctx, steps, caps, in_sync))
    if switch:
        if view.mode != "sync":
            back = plain if unequal else None
            pred = predict_sync(ctx.speeds, plain, ctx.ci, "plain sync", steps=steps)
            out.append(
                _candidate(
                    "switch:sync", lambda why, g: SwitchMode("sync", why, None, back, g), pred, view.switch_seconds
                )
            )
        groups = speed_groups(ctx.speeds, view.policy.recover_threshold, group_size_target(len(ctx.speeds)))
        if len(groups) > 1 and ctx.hierarchical_ok:
            hb = paced_group_batches(ctx.speeds, groups, total, caps) if view.allows(Action.REBALANCE) else plain
            frozen = tuple(tuple(g) for g in groups)
            hb_out = hb if hb != plain or unequal else None
            pred = predict_hierarchical(ctx.speeds, hb, groups, ctx.ci)
            out.append(
                _candidate(
                    "switch:hierarchical",
                    lambda why, g: SwitchMode("hierarchical", why, frozen, hb_out, g),
                    pred,
                    view.switch_seconds,
                    CLUSTER_PREFERENCE if shape is Shape.CLUSTERS else 0.0,
                )
            )
        if view.mode != "async" and ctx.async_ok:
            back = plain if unequal else None
            pred = predict_async(ctx.speeds, plain, ctx.ci)
            out.append(
                _candidate(
                    "switch:async", lambda why, g: SwitchMode("async", why, None, back, g), pred, view.switch_seconds
                )
            )
    return out


def _trim(
    ctx: DecisionContext, steps: Mapping[int, StepTime], caps: Mapping[int, int], in_sync: bool
) -> list[Candidate]:
    """Sync with the fast ranks at the job's batch and each slow one at what it finishes in their
    step (`plans.trimmed_batches`): the global batch shrinks, and under a linear lrScaling the
    learning rate with it, which the measured noise scale says is worth more per sample
    (`Efficiency.sync_batch_worth`). Proposed only where it is: measured, a plain optimizer, linear
    lrScaling; the prior would value it as a rebalance that loses a little to more exchanges."""
    view = ctx.view
    rates = {r: st.rate for r, st in steps.items()}
    t = trimmed_batches(rates, view.base_batch, caps, {r: st.fixed for r, st in steps.items()})
    total = sum(t.values())
    if total >= view.base_batch * len(ctx.speeds) or ctx.ci.efficiency.sync_batch_worth(total) < 1.0 + TRIM_WORTH:
        return []
    pred = predict_sync(ctx.speeds, t, ctx.ci, f"trimmed sync ({total} samples a step)", steps=steps)
    make: Make = (
        (lambda why, g: Rebalance(t, why, g)) if in_sync else (lambda why, g: SwitchMode("sync", why, None, t, g))
    )
    cost = view.rebalance_seconds if in_sync else view.switch_seconds
    return [_candidate("trim", make, pred, cost, batch_only=in_sync)]


def _candidate(
    key: str,
    make: Make,
    pred: Prediction,
    cost: float,
    preference: float = 0.0,
    restoring: bool = False,
    batch_only: bool = False,
    restarts: bool = False,
    removes: tuple[int, ...] = (),
) -> Candidate:
    return Candidate(
        key, make, pred, cost, preference, restoring, batch_only=batch_only, restarts=restarts, removes=removes
    )


def _grow(ctx: DecisionContext) -> list[Candidate]:
    """Back to the goal's nodes, the new ranks assumed at the fleet's median speed (see the module
    docstring for when it is proposed). Restoring: it needs no gain, only no predicted loss."""
    view = ctx.view
    target = view.goal
    if not view.allows(Action.RESCALE) or target <= view.replicas:
        return []
    world = len(ctx.speeds)
    new = list(range(world, world + (target - view.replicas) * view.nproc_per_node))
    speeds = {**ctx.speeds, **{r: ctx.health.median_speed for r in new}}
    batches = {r: view.batch(r) for r in speeds}
    groups = [*current_groups(ctx), new] if view.mode == "hierarchical" else None
    label = f"grow to {target} nodes"
    pred = predict_config(ctx, view.mode, speeds, batches, groups, label, view.lr_ratio(len(speeds)))
    return [
        Candidate(
            f"grow:{target}",
            lambda why, g: Rescale(target, why, (), g),
            pred,
            view.restart_seconds,
            restoring=True,
            settle=True,
            restarts=True,
        )
    ]


def straggler_node(ctx: DecisionContext) -> tuple[int, list[int], bool] | None:
    """The worst flagged rank, every rank on its node, and whether the node is to blame (all of its
    ranks are slow; with one rank per node the rank is the node)."""
    flagged = [h for h in ctx.health.ranks.values() if h.flagged]
    if not flagged:
        return None
    worst = max(flagged, key=lambda h: h.ratio)
    if worst.node is None:
        return worst.rank, [worst.rank], False
    on_node = sorted(r for r, n in ctx.nodes.items() if n == worst.node)
    return worst.rank, on_node, all(ctx.health.ranks[r].flagged for r in on_node if r in ctx.health.ranks)


def steady_straggler(ctx: DecisionContext, rank: int) -> bool:
    """`rank` is slower than the median by stragglerThreshold at the steady speeds too (over its last
    few windows, `state.SpeedEstimate.steady`), not only at speeds a jump restarted from one or two
    windows. A replacement or a removal restarts the world and is paid for over the rest of the job:
    on real nodes of equal 0.6-CPU quotas a rank that read 1.85x slower for two windows was removed
    (and added back 260 steps later), and the job took 1.11x DDP's time."""
    h = ctx.health.ranks.get(rank)
    return h is not None and h.steady_ratio >= ctx.view.policy.straggler_threshold


def removal_target(ctx: DecisionContext) -> tuple[tuple[int, list[int], bool] | None, str]:
    """The worst flagged rank a replacement or removal may take, as `straggler_node` gives it (None
    when there is none), and, when a rank is flagged but its steady speed does not make it a
    straggler yet (`steady_straggler`), why not. The one gate both the candidates and the reasons read."""
    found = straggler_node(ctx)
    if found is None or steady_straggler(ctx, found[0]):
        return found, ""
    h = ctx.health.ranks[found[0]]
    return None, (
        f"; no replacement or removal of rank {h.rank} yet: it is {h.steady_ratio:.2f}x slower than the median "
        f"at its steady speed (its last windows together), and one needs "
        f"stragglerThreshold {ctx.view.policy.straggler_threshold:g}x there"
    )


def removal_gate_note(ctx: DecisionContext) -> str:
    """Why no replacement or removal is proposed for the worst flagged rank although the job allows
    one ('' when one is, or none is allowed, or no rank is flagged). Said in the reasons (the
    operator's log of each keep, the Event of a split made meanwhile), which otherwise left a slow
    rank on its node with no word why."""
    view = ctx.view
    if not (view.allows(Action.REPLACE_WORKER) or view.allows(Action.RESCALE)):
        return ""
    return removal_target(ctx)[1]


def _membership(ctx: DecisionContext) -> list[Candidate]:
    view = ctx.view
    found, _ = removal_target(ctx)
    if found is None:
        return []
    rank, on_node, node_bound = found
    if all(r in on_node for r in ctx.speeds):
        # The node holds every rank (several pods on one node, or one with nprocPerNode > 1): replacing
        # or removing it predicts a fleet with no rest to take its place, and keeping the job off it
        # would leave the job nowhere to run.
        return []
    # A membership change restarts the world at the job's batch on every rank (driver.restarted).
    batches = {r: view.base_batch for r in ctx.speeds}
    out: list[Candidate] = []
    if view.allows(Action.REPLACE_WORKER) and view.min_replicas <= view.replicas - 1:
        healthy = [v for r, v in ctx.speeds.items() if r not in on_node]
        typical = sorted(healthy)[len(healthy) // 2] if healthy else ctx.health.median_speed
        fresh = {r: (typical if r in on_node else v) for r, v in ctx.speeds.items()}
        pred = predict_config(ctx, view.mode, fresh, batches, None, "replace")
        node = ctx.nodes.get(rank)
        exclude = node if node_bound else None
        pod = ctx.pods.get(rank)
        key = f"replace:{node if node is not None else rank}"
        out.append(
            _candidate(
                key,
                lambda why, g: ReplaceWorker(rank, why, pod, exclude, g),
                pred,
                view.restart_seconds,
                REPLACE_PREFERENCE,
                restarts=True,
                removes=(rank,),
            )
        )
    if view.allows(Action.RESCALE) and view.replicas - 1 >= view.min_replicas:
        rest = {r: v for r, v in ctx.speeds.items() if r not in on_node}
        if rest:
            pred = predict_config(ctx, view.mode, rest, batches, None, "rescale", view.lr_ratio(len(rest)))
            removed = tuple(on_node)
            target = view.replicas - 1
            node = ctx.nodes.get(rank)
            off = node if node_bound else None
            key = f"rescale:{node or rank}"
            out.append(
                _candidate(
                    key,
                    lambda why, g: Rescale(target, why, removed, g, off),
                    pred,
                    view.shrink_cost,
                    restarts=True,
                    removes=removed,
                )
            )
    return out
