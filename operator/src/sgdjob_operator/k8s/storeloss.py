"""A rendezvous store that stops answering (pure): re-homed before its node is declared lost.

Every torchrun agent of the job holds a connection to the store, and an agent that loses it ends its
workers. When the store's node loses power, the Node object still reads Ready for the node controller's
grace (40 s by default) and then `runPolicy.nodeLostGraceSeconds` more would pass before the lost-node
path (nodeloss.py) replaced the pod: over a minute and a half in which no worker can train. The
operator therefore asks the store's pod every pass whether it serves: GET /healthz at its health port,
which answers 200 only after a round trip through the store itself (rendezvous_store.py). A bare TCP
connect would not do: a hung store (stopped, its server thread deadlocked) still accepts connections,
the kernel completing them into its listen backlog. A store that

  * answered the operator before (one that never did may sit behind a network the operator cannot
    reach, e.g. an operator outside the cluster; judging it would only ever do harm),
  * has not answered since for `runPolicy.storeLostGraceSeconds` (refused, timed out, or not 200), and
  * saw the job make no progress meanwhile (a store the workers still reach while the operator does
    not, say a partition on the operator's side, leaves training going: nothing is done),

is force-deleted and recreated, kept off its old node (that node still looks Ready to the scheduler).
The Service keeps its name, so every agent finds the new store when it rendezvous again; the world
resumes from the last checkpoint. Failures of workers while the store is silent, or of workers that
were connected to a store that was replaced since, are the infrastructure's (failures.py).

An agent notices a dead store when its connection fails. Behind a cut network nothing fails: packets
are dropped, no reset comes back, and the agents (and their workers, in a collective with a peer
behind the cut) wait on the old store's connection for good; measured on real nodes, the survivors of
a cut stood still for over four minutes until the cut node's own kubelet killed the old store. So
workers created before the move that are still running `STRANDED_GRACES` store graces after it, while
the job is still at the step it had then, are restarted (deleted gracefully and recreated; not counted
against backoffLimit). Their new agents rendezvous at the new store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sgdjob_operator.api.models import ControllerState, StoreMove, StoreSilence
from sgdjob_operator.k8s.status import PodView, parse_time, rdzv_pods, rfc3339, workers
from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_CLOSED

# How long after a move (in storeLostGraceSeconds) workers that kept their old agents may take to
# train again before they are taken for stranded: a power cut's survivors, whose connections fail at
# once, resumed 18-32 s after the move in the chaos suite's runs (loaded 2-core machine).
STRANDED_GRACES = 6


@dataclass(frozen=True, slots=True)
class Rehome:
    pod: str
    node: str | None
    why: str  # for the Event, the pod's deletion and the job's record


def store_to_probe(pods: Sequence[PodView]) -> PodView | None:
    """The store's pod worth a health check: running with an address, not being replaced."""
    return next((p for p in rdzv_pods(pods) if p.phase == "Running" and p.ip and not p.deleting), None)


def follow_store(
    ctl: ControllerState, store: PodView | None, answered: bool | None, *, step: int, now: float, grace_s: float
) -> Rehome | None:
    """Update the store's record in `ctl` from this pass's health check (`answered` None: not probed)
    and say whether to re-home it now."""
    if store is None or answered is None:
        if store is None:
            ctl.store_silence = None
        return None
    if answered:
        ctl.store_answered, ctl.store_silence = store.uid, None
        return None
    if ctl.store_answered != store.uid:
        return None  # never reached: nothing to compare with (see the module docstring)
    silence = ctl.store_silence
    if silence is None or silence.pod_uid != store.uid or step > silence.step:
        # Newly silent, or the job moved on since: the workers still have a store, count afresh.
        ctl.store_silence = StoreSilence(pod_uid=store.uid, since=rfc3339(now), step=step)
        return None
    since = parse_time(silence.since) or now
    if now - since < grace_s:
        return None
    where = f" on node {store.node}" if store.node else ""
    why = (
        f"rendezvous store {store.name}{where} has not answered its health check since {silence.since} "
        f"({now - since:.0f}s, storeLostGraceSeconds {grace_s:.0f}) and the job made no progress past step {step}"
    )
    ctl.store_silence = None
    ctl.store_move = StoreMove(time=rfc3339(now), node=store.node, reason=why, step=step)
    return Rehome(store.name, store.node, why)


def closed_store(ctl: ControllerState, pods: Sequence[PodView], *, step: int, now: float) -> Rehome | None:
    """The store to replace because its rendezvous is closed for good, or None. torchrun's agents close
    the rendezvous when they end for lack of restarts (a script that crashed over and over spends
    every agent's --max-restarts in seconds); every later agent then exits EXIT_RENDEZVOUS_CLOSED at
    once, which spends no backoffLimit (failures.py, rule 4). Kept, the store turned the job into a
    loop of pods that could never train and never failed the job (measured on real nodes: a script
    that crashed at import, two crashes counted, then new pods every few seconds for minutes). So a
    worker that found the store it could have joined closed (the store's pod created before the
    worker's), in a job none of whose workers succeeded, gets the store replaced: the next world
    forms on a fresh one, and backoffLimit counts the crashes until the job runs or fails."""
    if any(p.phase == "Succeeded" for p in workers(pods)):
        return None  # the world ended because training did: a late pod's closed store is no fault
    store = next((p for p in rdzv_pods(pods) if not p.deleting), None)
    if store is None or store.created is None:
        return None
    turned_away = [
        p
        for p in workers(pods)
        if p.phase == "Failed" and p.exit_code == EXIT_RENDEZVOUS_CLOSED and (p.created or 0.0) >= store.created
    ]
    if not turned_away:
        return None
    why = (
        f"rendezvous store {store.name} has closed its rendezvous ({turned_away[0].name} exited with code "
        f"{EXIT_RENDEZVOUS_CLOSED} on joining): the agents ended their world, so no worker can join it again"
    )
    # No node to avoid: the store's node is healthy, only its rendezvous is spent.
    moved(ctl, store, now, why, step, avoid=False)
    return Rehome(store.name, None, why)


def moved(ctl: ControllerState, store: PodView, now: float, why: str, step: int, *, avoid: bool = True) -> None:
    """Record a store replaced (its node lost, nodeloss.py; its rendezvous closed) for the failure
    rules; `avoid`: the next store stays off the old one's node."""
    ctl.store_silence = None
    ctl.store_move = StoreMove(time=rfc3339(now), node=store.node if avoid else None, reason=why, step=step)


def stranded_workers(
    ctl: ControllerState, workers: Sequence[PodView], *, step: int, now: float, grace_s: float
) -> tuple[list[str], str]:
    """The running workers still held by a store that was re-homed (created before the move, the job
    still at its step of the move STRANDED_GRACES x `grace_s` after it), and why; ([], "") when none."""
    move = ctl.store_move
    at = parse_time(move.time) if move is not None else None
    # Any other step than at the move is progress: a world resumed from an earlier checkpoint reports
    # a smaller one first, and may need more than the grace to pass the old step on slow hardware.
    if move is None or at is None or step != move.step or now - at < STRANDED_GRACES * grace_s:
        return [], ""
    stuck = [
        p.name for p in workers if p.phase == "Running" and not p.deleting and p.created is not None and p.created <= at
    ]
    why = (
        f"{', '.join(stuck)} made no progress from step {step} in {now - at:.0f}s since the rendezvous store "
        f"was re-homed ({STRANDED_GRACES} x storeLostGraceSeconds): their agents still wait on the old store"
    )
    return stuck, why if stuck else ""


def store_excluded(ctl: ControllerState, job_excluded: Sequence[str]) -> list[str]:
    """Nodes a new store pod stays off: the job's excluded nodes and the node the last store was
    re-homed from (until another move replaces the record)."""
    out = list(job_excluded)
    node = ctl.store_move.node if ctl.store_move is not None else None
    if node and node not in out:
        out.append(node)
    return out


def store_failure_cause(ctl: ControllerState, pod: PodView) -> str | None:
    """Why a failed worker's failure is the store's doing, or None: the store silent right now, or
    replaced after the worker's pod was created (the worker's agent held the old store)."""
    if ctl.store_silence is not None:
        return f"rendezvous store not answering since {ctl.store_silence.since}"
    move = ctl.store_move
    if move is None or pod.created is None:
        return None
    at = parse_time(move.time)
    if at is not None and pod.created <= at:
        where = f" from node {move.node}" if move.node else ""
        return f"its rendezvous store was re-homed{where} at {move.time}"
    return None
