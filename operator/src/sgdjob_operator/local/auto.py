"""The auto mode of `sgdjob run`: the operator's policy core driving local workers.

A poll hook for `run_local`. Every `policy.intervalSeconds` it feeds the latest scrape to
`policy.evaluate` and applies the decision the way the operator does: the wanted control command
is level-triggered (re-pushed on every poll until rank 0 reports its epoch), and no new decision is
taken while one is still in flight. Membership changes (replace a worker, rescale within min/max)
go through `LocalRun.replace`/`rescale`, which stop and start agents; until every rank of the new
world reports, nothing else is decided, and then the policy starts over (ranks were handed out
anew) with its cooldown running from the change.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.api.models import SGDJob
from sgdjob_operator.local.progress import Display, ProgressFrame
from sgdjob_operator.local.runner import LocalRun
from sgdjob_operator.policy import Keep, PolicyState, Rebalance, ReplaceWorker, Rescale, SwitchMode, evaluate, job_view
from sgdjob_operator.workers.scrape import ScrapeResult
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand


def command_for(decision: SwitchMode | Rebalance, epoch: int, batch_sizes: dict[int, int]) -> ControlCommand:
    """The control command that carries out a mode switch or a rebalance (pure)."""
    if isinstance(decision, SwitchMode):
        sizes = dict(decision.batch_sizes) if decision.batch_sizes is not None else None
        groups = [list(g) for g in decision.groups] if decision.groups is not None else None
        return ControlCommand(epoch=epoch, mode=SyncMode(decision.mode), groups=groups, batch_sizes=sizes, reason=decision.reason)
    return ControlCommand(epoch=epoch, batch_sizes={**batch_sizes, **dict(decision.batch_sizes)}, reason=decision.reason)


def applied_epoch(results: Sequence[ScrapeResult]) -> int | None:
    """The control epoch rank 0 reports as applied, None when rank 0 was not reached."""
    for result in results:
        status = result.status
        if status is not None and status.rank == 0:
            return status.control_epoch
    return None


# What a membership change costs on one machine, for the policy's payback test: stopping the
# leaving agent at an agreed step, a new rendezvous round and every worker resuming from the
# checkpoint, about 10-15 s on 2 cores (the operator's default of 60 s is for pods on new nodes).
LOCAL_RESTART_SECONDS = 15.0
# A membership change that has not settled by then is left to the supervisor's failure handling.
SETTLE_TIMEOUT_S = 180.0


def settled(results: Sequence[ScrapeResult], world: int) -> bool:
    """Every rank of a world of `world` reports, each seeing that world size (pure)."""
    ranks = {r.sample.rank for r in results if r.sample is not None and r.sample.world_size == world}
    return ranks == set(range(world))


def node_of(results: Sequence[ScrapeResult], rank: int) -> str | None:
    for result in results:
        if result.sample is not None and result.sample.rank == rank:
            return result.sample.node or result.endpoint.node
    return None


def active_mode(snap: ProgressFrame, fallback: str) -> str:
    modes = {w.mode for w in snap.workers if w.fresh and not w.done}
    return modes.pop() if len(modes) == 1 else fallback


@dataclass
class AutoController:
    """Policy state and the command in flight for one local run."""

    job: SGDJob
    display: Display
    clock: Callable[[], float] = time.time
    state: PolicyState = field(default_factory=PolicyState)
    mode: str = SyncMode.SYNC.value
    epoch: int = 0
    wanted: ControlCommand | None = None
    batch_sizes: dict[int, int] = field(default_factory=dict)
    groups: list[list[int]] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    last_eval: float | None = None
    start: float = field(default_factory=time.time)
    settling_since: float | None = None  # a membership change waits for the new world to report

    def _record(self, decision: Any, snap: ProgressFrame, applied: bool, note: str = "") -> None:
        entry = {"time_s": round(snap.elapsed_s, 3), "step": snap.step, **decision.to_dict(), "applied": applied}
        if note:
            entry["note"] = note
        self.decisions.append(entry)
        what = decision.action if not isinstance(decision, SwitchMode) else f"switch to {decision.mode}"
        self.display.note(f"[{snap.elapsed_s:6.1f}s] decision at step {snap.step}: {what}: {decision.reason}{' (' + note + ')' if note else ''}")

    async def __call__(self, run: LocalRun, results: list[ScrapeResult], snap: ProgressFrame) -> None:
        self.mode = active_mode(snap, self.mode)
        run.report_extra["mode"] = "auto"
        run.report_extra["decisions"] = self.decisions
        epoch = applied_epoch(results)
        if self.settling_since is not None:
            if not settled(results, run.fleet.world_size()) and self.clock() - self.settling_since < SETTLE_TIMEOUT_S:
                return
            await self._settle(run, epoch)
            return
        if self.wanted is not None:
            if epoch is not None and epoch >= self.wanted.epoch:
                self.wanted = None  # the workers run it: the change is no longer in flight
            else:
                await run.push(self.wanted)  # level-triggered: re-push until rank 0 reports it
                return
        now = self.clock()
        if self.last_eval is not None and now - self.last_eval < self.job.spec.policy.interval_seconds:
            return
        self.last_eval = now
        samples = [r.sample for r in results if r.sample is not None]
        if not samples or any(w.done for w in snap.workers):
            return
        view = job_view(
            self.job.spec,
            mode=self.mode,
            replicas=len(run.fleet.nodes()),
            batch_sizes=self.batch_sizes,
            groups=self.groups,
            restart_seconds=LOCAL_RESTART_SECONDS,
        )
        evaluation = evaluate(self.state, samples, view, now)
        self.state = evaluation.state
        decision = evaluation.decision
        if isinstance(decision, Keep):
            return
        if isinstance(decision, SwitchMode | Rebalance):
            self.epoch = max(self.epoch, epoch or 0) + 1
            self.wanted = command_for(decision, self.epoch, self.batch_sizes)
            if self.wanted.batch_sizes is not None:
                self.batch_sizes = dict(self.wanted.batch_sizes)
            if self.wanted.groups is not None:
                self.groups = self.wanted.groups
            self._record(decision, snap, applied=True)
            await run.push(self.wanted)
        elif isinstance(decision, ReplaceWorker):
            node = decision.exclude_node or node_of(results, decision.rank)
            if node is None or node not in run.fleet.nodes():
                self._record(decision, snap, applied=False, note=f"rank {decision.rank}'s node is not known")
                return
            self._record(decision, snap, applied=True, note=f"node {node} leaves, local-{run.fleet.next_index} joins")
            await run.replace(node, SyncMode(self.mode), decision.reason)
            self._changed(run)
        elif isinstance(decision, Rescale):
            spec = self.job.spec
            target = max(spec.min_workers, min(spec.max_workers, decision.replicas))
            if target == len(run.fleet.nodes()):
                return
            remove = tuple(n for n in (node_of(results, r) for r in decision.remove_ranks) if n is not None)
            self._record(decision, snap, applied=True, note=f"{len(run.fleet.nodes())} -> {target} nodes")
            await run.rescale(target, SyncMode(self.mode), decision.reason, remove)
            self._changed(run)

    def _changed(self, run: LocalRun) -> None:
        self.settling_since = self.clock()
        self.display.resize(len(run.fleet.nodes()), run.fleet.world_size())
        self.display.note(f"nodes now: {', '.join(run.fleet.nodes())}; waiting for the new world to resume from the checkpoint")

    async def _settle(self, run: LocalRun, epoch: int | None) -> None:
        """The new world reports (or waited long enough): start the policy over, keep the cooldown
        running from the change, and drop per-rank batch sizes and groups, which named old ranks."""
        now = self.clock()
        self.settling_since = None
        self.state = dataclasses.replace(PolicyState(), last_change=now, jitter=self.state.jitter)
        self.last_eval = now
        self.groups = None
        self.epoch = max(self.epoch, epoch or 0)
        if self.batch_sizes:
            self.batch_sizes = {}
            base = self.job.spec.training.batch_size
            self.epoch += 1
            plain = {r: base for r in range(run.fleet.world_size())}
            self.wanted = ControlCommand(epoch=self.epoch, batch_sizes=plain, reason="membership changed: per-rank batch sizes reset")
            await run.push(self.wanted)
