"""The auto mode of `sgdjob run`: the operator's policy core driving local workers.

A poll hook for `run_local`. Every `policy.intervalSeconds` it feeds the latest scrape to
`policy.evaluate` and applies the decision the way the operator does: the wanted control command
is level-triggered (re-pushed on every poll until rank 0 reports its epoch), and no new decision is
taken while one is still in flight. Membership changes (replace, rescale) need the runner to start
and stop agents, which this hook asks for through `LocalRun`'s membership methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgdjob_operator.api.models import SGDJob
from sgdjob_operator.local.progress import Display, Snapshot
from sgdjob_operator.local.runner import LocalRun
from sgdjob_operator.policy import Keep, PolicyState, Rebalance, ReplaceWorker, Rescale, SwitchMode, evaluate, job_view
from sgdjob_operator.scrape import ScrapeResult
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.control import ControlCommand


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
        if status is not None and status.get("rank") == 0:
            epoch = status.get("controlEpoch")
            return int(epoch) if isinstance(epoch, int) else 0
    return None


def active_mode(snap: Snapshot, fallback: str) -> str:
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

    def _record(self, decision: Any, snap: Snapshot, applied: bool, note: str = "") -> None:
        entry = {"time_s": round(snap.elapsed_s, 3), "step": snap.step, **decision.to_dict(), "applied": applied}
        if note:
            entry["note"] = note
        self.decisions.append(entry)
        what = decision.action if not isinstance(decision, SwitchMode) else f"switch to {decision.mode}"
        self.display.note(f"[{snap.elapsed_s:6.1f}s] decision at step {snap.step}: {what}: {decision.reason}{' (' + note + ')' if note else ''}")

    async def __call__(self, run: LocalRun, results: list[ScrapeResult], snap: Snapshot) -> None:
        self.mode = active_mode(snap, self.mode)
        run.report_extra["mode"] = "auto"
        run.report_extra["decisions"] = self.decisions
        epoch = applied_epoch(results)
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
        view = job_view(self.job.spec, mode=self.mode, batch_sizes=self.batch_sizes, groups=self.groups)
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
        elif isinstance(decision, ReplaceWorker | Rescale):
            self._record(decision, snap, applied=False, note="membership changes are not applied by the local runner yet")
