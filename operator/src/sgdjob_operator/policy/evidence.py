"""What a change's own evidence allows, beside the fleet's shape and the candidates' predictions.

- A removal rests on the ranks it removes: the fleet's shape may still be transient (its name
  changes with every rank's noise) while each removed rank has been slow for persistenceIntervals
  windows (`transient_for`), and the best change may have been another one in those windows
  (`removal_persisted`).
- A change still under check (`policy.check`) is not made again while its own windows so far show
  less gain than a change must promise (`unproven_repeat`): the repeat rests on the model whose last
  prediction those windows contradict, and so does any other change the model predicts; only a
  removal (resting on the removed ranks' own slowness) or the way back to plain sync remains.
"""

from __future__ import annotations

from sgdjob_operator.policy.candidates import Candidate
from sgdjob_operator.policy.health import JobHealth, Shape
from sgdjob_operator.policy.progress import Progress
from sgdjob_operator.policy.trial import Trial


def transient_for(chosen: Candidate, health: JobHealth) -> bool:
    """The fleet's shape holds `chosen` back as transient: it has not kept its name for
    persistenceIntervals windows, unless `chosen` takes off ranks that have each been slow that long
    (`JobHealth.stragglers`). The name depends on every rank, the removal's evidence only on the ranks
    it removes: on real nodes whose fast ranks read 1,100-2,200 samples/s from window to window, the
    fleet's name went from "single straggler" to "3 speed clusters" and back, and a removal of the
    0.27-CPU rank, slow in every window, waited 6-7 s of a 20-s job."""
    if health.shape is not Shape.TRANSIENT:
        return False
    return not removal_persisted(chosen, health)


def removal_persisted(chosen: Candidate, health: JobHealth) -> bool:
    """`chosen` takes off ranks that have each been slow for persistenceIntervals windows: it has
    persisted as a change must, whichever change predicted most in those windows. On real nodes the
    best change for one 0.27-CPU rank went rebalance, rescale, hierarchical, rescale in four windows
    (each prediction within its noise of the others), and persistence, counted per change, held the
    shrink for all four."""
    return bool(chosen.removes) and set(chosen.removes) <= set(health.stragglers)


def unproven_repeat(
    candidates: list[Candidate], pending: Trial | None, progress: Progress, margin_needed: float
) -> tuple[list[Candidate], str]:
    """The candidates without another change of the kind still under check (`pending`, no verdict
    yet) while its own windows so far measured less gain over the configuration it left than a change
    must promise to be made (`margin_needed`, switchMargin), and the note a reason then carries. Such
    a repeat rests on the model whose last prediction its results so far contradict: on a real node
    bound by its CPU quota, a cut of the slow rank's batch predicted +217 % and delivered less than
    before, and a second cut from the same model (+172 %) held off the shrink that the same fleet paid
    for at once in the other seeds (rescale at step 67 instead of 16-24). The other candidates stay;
    the check itself still takes the change back or keeps it. Nor is any other change of the model's
    made meanwhile, a removal and the way back to plain sync excepted: the randomized no-flapping
    search found a split made as the fleet slowed 1.7x, checked against the faster fleet's tally, and
    async (+10 %, from the same model) made in the same phase."""
    if pending is None or progress.since is None or progress.tally.windows < 1.0:
        return candidates, ""
    if progress.tally.mean >= pending.before.mean * (1.0 + margin_needed):
        return candidates, ""
    if not any(c.key == pending.key for c in candidates):
        return candidates, ""
    kept = [c for c in candidates if c.removes or c.restoring]
    note = (
        f"; no second {pending.label} before the check of the last one: it measured {progress.tally.mean:.4g} useful "
        f"samples/s vs {pending.before.mean:.4g} before it (predicted {pending.predicted:.4g}); nor any other "
        "change from the same model meanwhile, but a removal or plain sync"
    )
    return kept, note
