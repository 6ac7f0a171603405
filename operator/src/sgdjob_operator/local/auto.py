"""The auto mode of `sgdjob run`: the decision driver (`policy.driver`) driving local workers.

A poll hook for `run_local`. The wanted control command is level-triggered (re-sent on every poll
until rank 0 reports its epoch); every `policy.intervalSeconds` the latest scrape goes to the
driver and its action is carried out by `LocalActuator`. The first call for a world waits, if the
workers date their training start, until the window from that start gives every rank a rate
(`policy.driver.first_call_wait`), so no interval is spent on a baseline. Membership changes (replace a worker,
rescale) go through the run's `replace`/`rescale`, which stop and start agents; until every rank of
the new world reports, the change is in flight, and then the driver starts over (ranks were handed
out anew) with its cooldown running from the change.

This module does not import the runner (which imports it): `RunHandle` is what it needs of a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sgdjob_operator.api.models import SGDJob
from sgdjob_operator.local.progress import Display, ProgressFrame
from sgdjob_operator.policy.decisions import Decision, SwitchMode
from sgdjob_operator.policy.driver import (
    DriverState,
    Observed,
    PlatformCosts,
    Push,
    Replace,
    Scale,
    act,
    drive,
    first_call_wait,
    pending,
    restarted,
    unanimous_mode,
)
from sgdjob_operator.policy.restart import restart_took, shrink_estimate
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.workers.scrape import ControlResult, ScrapeResult
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand


class Membership(Protocol):
    """What the controller reads of the run's agents (`fleet.Fleet` is one)."""

    @property
    def next_index(self) -> int: ...

    def nodes(self) -> list[str]: ...

    def world_size(self) -> int: ...


class RunHandle(Protocol):
    """What the controller needs of a running job (`runner.LocalRun` is one)."""

    @property
    def fleet(self) -> Membership: ...

    @property
    def report_extra(self) -> dict[str, Any]: ...

    async def push(self, command: ControlCommand) -> ControlResult: ...

    def poll_within(self, seconds: float) -> None: ...

    async def replace(self, node: str, mode: SyncMode, reason: str) -> None: ...

    async def rescale(self, nodes: int, mode: SyncMode, reason: str, remove: tuple[str, ...] = ()) -> None: ...


def applied_epoch(results: Sequence[ScrapeResult]) -> int | None:
    """The control epoch rank 0 reports as applied, None when rank 0 was not reached."""
    for result in results:
        status = result.status
        if status is not None and status.rank == 0:
            return status.control_epoch
    return None


def training_began(samples: Sequence[WorkerSample]) -> float | None:
    """When the first of these workers began training, in the samples' (this controller's) clock;
    None when none dates its start (pure)."""
    starts = [s.time - s.training_seconds for s in samples if s.training_seconds is not None]
    return min(starts) if starts else None


def training_start(samples: Sequence[WorkerSample], snap: ProgressFrame) -> float | None:
    """Seconds into the run when the first of these workers began training (pure)."""
    began = training_began(samples)
    return None if began is None else began - (snap.time - snap.elapsed_s)


# What a membership change costs on one machine, for the policy's payback test, until this run has
# measured its own (its launch, then each change: `policy.restart`): stopping the leaving agent at an
# agreed step, a new rendezvous round and every worker resuming from the checkpoint, about 10-15 s on
# 2 cores (the operator's default of 60 s is for pods on new nodes).
LOCAL_COSTS = PlatformCosts(restart_seconds=15.0)
# A membership change that has not settled by then is left to the supervisor's failure handling.
SETTLE_TIMEOUT_S = 180.0


def settled(results: Sequence[ScrapeResult], world: int) -> bool:
    """Every rank of a world of `world` reports, each seeing that world size (pure)."""
    ranks = {r.sample.rank for r in results if r.sample is not None and r.sample.world_size == world}
    return ranks == set(range(world))


@dataclass
class AutoController:
    """The driver's state and the decisions taken, for one local run."""

    job: SGDJob
    display: Display
    clock: Callable[[], float] = time.time
    state: DriverState = field(default_factory=DriverState)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    last_eval: float | None = None
    settling_since: float | None = None  # a membership change waits for the new world to report
    problem: str = ""
    training_start_s: float | None = None  # seconds into the run when the first world began training
    restart_seconds: float | None = None  # the latest (re)start's measured length: the launch, then changes
    restart_from: float | None = None  # when the membership change being measured began
    shrink_seconds: float | None = None  # the latest shrink's measured length
    restart_shrinks: bool = False  # the change being measured only removed nodes

    async def __call__(self, run: RunHandle, results: list[ScrapeResult], snap: ProgressFrame) -> None:
        run.report_extra["mode"] = "auto"
        run.report_extra["decisions"] = self.decisions
        epoch = applied_epoch(results)
        samples = [r.sample for r in results if r.sample is not None]
        if self.training_start_s is None:
            self.training_start_s = training_start(samples, snap)
            if self.training_start_s is not None:
                run.report_extra["training_start_s"] = round(self.training_start_s, 3)
        self._measure_restart(run, samples, snap)
        if self.settling_since is not None:
            if not settled(results, run.fleet.world_size()) and self.clock() - self.settling_since < SETTLE_TIMEOUT_S:
                return
            await self._settle(run, epoch)
            return
        command = pending(self.state, epoch, unanimous_mode(samples))
        if command is not None:
            await run.push(command)  # level-triggered: re-sent until rank 0 reports it
        now = self.clock()
        interval = self.job.spec.policy.interval_seconds
        if not samples or (self.last_eval is not None and now - self.last_eval < interval):
            return
        wait = first_call_wait(self.state, samples, interval)
        if wait > 0:  # the first call waits until the window from the training start gives a rate
            run.poll_within(wait)
            return
        self.last_eval = now
        finishing = "a worker has finished" if any(w.done for w in snap.workers) else ""
        observed = Observed(
            samples,
            replicas=len(run.fleet.nodes()),
            applied_epoch=epoch,
            in_flight=finishing,
            step=snap.step or None,
        )
        restart = LOCAL_COSTS.restart_seconds if self.restart_seconds is None else self.restart_seconds
        costs = replace(
            LOCAL_COSTS, restart_seconds=restart, shrink_seconds=shrink_estimate(self.shrink_seconds, restart, samples)
        )
        step = drive(self.state, observed, self.job.spec, now, costs)
        self.state = step.state
        if step.problem and step.problem != self.problem:
            self.display.note(f"[{snap.elapsed_s:6.1f}s] {step.problem}")
        self.problem = step.problem
        if step.action is not None:
            await act(step.action, LocalActuator(self, run, snap))

    def _measure_restart(self, run: RunHandle, samples: Sequence[WorkerSample], snap: ProgressFrame) -> None:
        """What the launch, then each membership change, took until every rank of the world trained."""
        if self.restart_from is not None:
            took, since = restart_took(samples, self.restart_from), "change"
            self.restart_from = None if took is not None else self.restart_from
        elif self.restart_seconds is None:
            took, since = restart_took(samples, snap.time - snap.elapsed_s), "launch"
        else:
            return
        if took is not None:
            if since == "change" and self.restart_shrinks:
                self.shrink_seconds, since = took, "shrink"
            else:
                self.restart_seconds = took
            run.report_extra.setdefault("restarts_measured", []).append({"from": since, "seconds": took})

    def record(self, decision: Decision, snap: ProgressFrame, applied: bool, note: str = "") -> None:
        entry = {"time_s": round(snap.elapsed_s, 3), "step": snap.step, **decision.to_dict(), "applied": applied}
        if note:
            entry["note"] = note
        self.decisions.append(entry)
        what = decision.action if not isinstance(decision, SwitchMode) else f"switch to {decision.mode}"
        suffix = f" ({note})" if note else ""
        self.display.note(f"[{snap.elapsed_s:6.1f}s] decision at step {snap.step}: {what}: {decision.reason}{suffix}")

    def changed(self, run: RunHandle, began: float, *, shrink: bool = False) -> None:
        """The membership change that `began` (this controller's clock) has been applied. The new world's
        start is measured from `began`, not from now: applying it waits for the leaving agents to exit,
        and the survivors may re-form and train meanwhile (a start dated before the change's end would
        never be measured)."""
        self.restart_from = began
        self.settling_since = self.clock()
        self.restart_shrinks = shrink
        self.display.resize(len(run.fleet.nodes()), run.fleet.world_size())
        nodes = ", ".join(run.fleet.nodes())
        self.display.note(f"nodes now: {nodes}; waiting for the new world to resume from the checkpoint")

    async def _settle(self, run: RunHandle, epoch: int | None) -> None:
        """The new world reports (or waited long enough): the driver starts over."""
        now = self.clock()
        self.settling_since = None
        self.last_eval = now
        world, base = run.fleet.world_size(), self.job.spec.training.batch_size
        self.state, command = restarted(self.state, now, world, base, epoch)
        if command is not None:
            await run.push(command)


@dataclass
class LocalActuator:
    """Carries the driver's actions out on a local run and records them for report.json."""

    controller: AutoController
    run: RunHandle
    snap: ProgressFrame

    async def push(self, action: Push) -> None:
        self.controller.record(action.decision, self.snap, applied=True)
        await self.run.push(action.command)

    async def replace(self, action: Replace) -> None:
        node = action.exclude_node or action.node
        if node is None or node not in self.run.fleet.nodes():
            unknown = f"rank {action.rank}'s node is not known"
            self.controller.record(action.decision, self.snap, applied=False, note=unknown)
            return
        self.controller.record(
            action.decision,
            self.snap,
            applied=True,
            note=f"node {node} leaves, local-{self.run.fleet.next_index} joins",
        )
        began = self.controller.clock()
        await self.run.replace(node, SyncMode(action.mode), action.decision.reason)
        self.controller.changed(self.run, began)

    async def scale(self, action: Scale) -> None:
        note = f"{action.current} -> {action.replicas} nodes"
        self.controller.record(action.decision, self.snap, applied=True, note=note)
        began = self.controller.clock()
        await self.run.rescale(action.replicas, SyncMode(action.mode), action.decision.reason, action.remove_nodes)
        self.controller.changed(self.run, began, shrink=action.replicas < action.current)
