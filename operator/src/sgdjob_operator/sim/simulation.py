"""Run one scenario in one mode: a static configuration, or `auto` with the policy in the loop.

`auto` calls the same decision driver the operator calls, every policy interval, with WorkerSamples
made from the simulated counters, keeps its state only in `DriverState.to_dict()` form (as the
operator keeps it in status), and carries each action out with its cost: a mode switch or rebalance
pauses for its switch time, a replacement or rescale restarts every worker from the latest
checkpoint (as torchrun's elastic agent does on a membership change), and so does a node death,
once it is detected.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgdjob_operator.api.models import JobMode
from sgdjob_operator.policy import Decision, SwitchMode, WorkerSample
from sgdjob_operator.policy.driver import DriverState, Observed, PlatformCosts, Push, Replace, Scale, act, drive
from sgdjob_operator.policy.job import DEFAULT_MAX_BATCH_FACTOR
from sgdjob_operator.policy.plans import (
    group_size_target,
    node_groups,
    paced_group_batches,
    rebalanced_batches,
    speed_groups,
)
from sgdjob_operator.sim.engines import AsyncEngine, Counters, Engine, Env, HierarchicalEngine, SyncEngine
from sgdjob_operator.sim.hardware import Floats, SimulatedFleet
from sgdjob_operator.sim.loss import loss_after
from sgdjob_operator.sim.scenario import Scenario

SYSTEMS = ("sync", "rebalanced", "hierarchical", "async", "auto")


@dataclass
class ModeResult:
    mode: str
    efficiency: float
    useful_samples: float
    final_loss: float
    switches: int = 0
    detection_delay_s: float | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class SimActuator:
    """Carries the driver's actions out in the simulation, with their costs: a switch or rebalance
    pauses the workers, a replacement or rescale restarts them from the latest checkpoint."""

    run: Run
    now: float
    workers: list[int]  # by rank

    def push(self, action: Push) -> None:
        run, d = self.run, action.decision
        run.record(d, self.now)
        t = run.engine.barrier()
        for r, b in (d.batch_sizes or {}).items():
            run.batches[self.workers[r]] = b
        if isinstance(d, SwitchMode):
            run.mode = d.mode
            run.groups = [[self.workers[r] for r in g] for g in d.groups] if d.groups else None
        pause = run.sc.costs.switch_seconds if isinstance(d, SwitchMode) else run.sc.costs.rebalance_seconds
        run.engine = run._engine(max(t, self.now) + pause)

    def replace(self, action: Replace) -> None:
        self.run.record(action.decision, self.now)
        self.run._restart(self.now, replace={int(self.run.fleet.node_of[self.workers[action.rank]])})

    def scale(self, action: Scale) -> None:
        self.run.record(action.decision, self.now)
        drop = {int(self.run.fleet.node_of[self.workers[r]]) for r in action.remove_ranks}
        self.run._restart(self.now, drop=drop, grow=max(0, action.replicas - action.current))


class Run:
    def __init__(self, sc: Scenario, label: str) -> None:
        if label not in SYSTEMS:
            raise ValueError(f"mode must be one of {', '.join(SYSTEMS)}, not {label!r}")
        self.sc, self.label = sc, label
        self.spec = sc.spec(JobMode.AUTO)
        self.fleet = SimulatedFleet(sc)
        self.duration = sc.duration
        n = self.fleet.size
        self.counters = Counters(n)
        self.training_start = 0.0  # when the workers' processes began training (counters count from it)
        self.env = Env(
            self.fleet,
            self.counters,
            np.random.default_rng(sc.seed + 1),
            sc.comm(),
            sc.noise,
            self.spec.policy.staleness_penalty,
        )
        self.alive = np.ones(n, dtype=bool)
        self.base = self.spec.training.batch_size
        self.caps = [c or DEFAULT_MAX_BATCH_FACTOR * self.base for c in self.fleet.caps]
        self.batches: Floats = np.full(n, float(self.base))
        self.groups: list[list[int]] | None = None
        self.mode = "sync"
        self.state_doc: dict[str, Any] = DriverState().to_dict()
        self.result = ModeResult(label, 0.0, 0.0, 0.0)
        self._static_config()
        self.engine: Engine = self._engine(0.0)

    def _static_config(self) -> None:
        """Static baselines are configured once, from the speeds at the start: what a user who
        measured the fleet would write into the spec."""
        speeds = {w: float(v) for w, v in enumerate(self.fleet.speeds(0.0))}
        caps = dict(enumerate(self.caps))
        total = self.base * self.fleet.size
        if self.label == "rebalanced":
            for w, b in rebalanced_batches(speeds, total, caps).items():
                self.batches[w] = b
        elif self.label == "hierarchical":
            self.mode = "hierarchical"
            self.groups = speed_groups(speeds, self.spec.policy.recover_threshold, group_size_target(self.fleet.size))
            for w, b in paced_group_batches(speeds, self.groups, total, caps).items():
                self.batches[w] = b
        elif self.label == "async":
            self.mode = "async"

    def _engine(self, t0: float) -> Engine:
        members = np.nonzero(self.alive)[0]
        training = self.spec.training
        if self.mode == "async":
            return AsyncEngine(self.env, members, self.batches, t0, training.async_.staleness, training.async_.shards)
        if self.mode == "hierarchical":
            groups = self.groups or node_groups({int(w): self.fleet.worker_node_name(int(w)) for w in members})
            arrays = [np.array(g, dtype=np.int64) for g in groups if g]
            return HierarchicalEngine(
                self.env, arrays, self.batches, t0, training.hierarchical.average_every, training.hierarchical.staleness
            )
        return SyncEngine(self.env, members, self.batches, t0)

    # ------------------------------------------------------------------ membership
    def _workers(self) -> list[int]:
        return [int(w) for w in np.nonzero(self.alive)[0]]

    def _restart(self, t: float, drop: Iterable[int] = (), replace: Iterable[int] = (), grow: int = 0) -> None:
        """Every worker restarts from the latest checkpoint, without `drop` nodes, with `replace`
        nodes swapped for fresh ones, and with `grow` fresh nodes in place of nodes gone before."""
        c = self.counters
        step_samples = self.base * self.fleet.size
        interval = self.spec.training.checkpoint.interval_steps
        progress = c.processed / step_samples
        lost = (progress % interval) * step_samples
        if c.processed > 0:
            c.useful -= c.useful * lost / c.processed
            c.processed -= lost
        for node in replace:
            self.fleet.replace_node(node)
        for node in drop:
            self.alive[self.fleet.node_of == node] = False
        for node in sorted({int(n) for n in self.fleet.node_of[~self.alive]})[:grow]:
            workers = self.fleet.node_of == node
            self.fleet.replace_node(node)
            self.alive[workers] = True
        c.reset()
        self.training_start = t + self.sc.costs.restart_seconds
        if self.groups is not None:
            alive = set(self._workers())
            self.groups = [kept for g in self.groups if (kept := [w for w in g if w in alive])]
        self.engine = self._engine(self.training_start)

    def _detect_deaths(self, until: float, pending: list[tuple[float, int]]) -> None:
        while pending and pending[0][0] <= until:
            detected, node = pending.pop(0)
            if np.any(self.alive & (self.fleet.node_of == node)):
                self.engine.advance(detected)
                self._restart(detected, drop={node})

    # ------------------------------------------------------------------ policy
    def _samples(self, now: float, workers: list[int]) -> list[WorkerSample]:
        self.engine.flush()
        c = self.counters
        stale = c.take_staleness()
        nbytes = self.env.comm.gradient_bytes
        trained = now - self.training_start if now >= self.training_start else None
        out = []
        for rank, w in enumerate(workers):
            node = self.fleet.worker_node_name(w)
            out.append(
                WorkerSample(
                    rank=rank,
                    time=now,
                    steps=int(c.steps[w]),
                    samples=int(c.samples[w]),
                    compute_seconds=float(c.compute[w]),
                    comm_wait_seconds=float(c.wait[w]),
                    mode=self.mode,
                    batch_size=int(self.batches[w]),
                    node=node,
                    pod=f"pod-{node}",
                    staleness=float(stale[w]),
                    world_size=len(workers),
                    gradient_bytes=nbytes,
                    training_seconds=trained,
                )
            )
        return out

    def _policy(self, now: float) -> None:
        """One interval through the decision driver, as the operator and `sgdjob run` use it; the
        per-rank batch sizes and groups are the simulator's own (its ranks are renumbered on a
        membership change without any command)."""
        workers = self._workers()
        rank_of = {w: r for r, w in enumerate(workers)}
        hierarchical = bool(self.groups) and self.mode == "hierarchical"
        observed = Observed(
            self._samples(now, workers),
            replicas=len(workers) // self.fleet.nproc,
            batch_sizes={r: int(self.batches[w]) for r, w in enumerate(workers)},
            groups=[[rank_of[w] for w in g] for g in self.groups or []] if hierarchical else None,
        )
        costs = PlatformCosts(
            comm=self.env.comm,
            max_batch_sizes={r: self.caps[w] for r, w in enumerate(workers)},
            restart_seconds=self.sc.costs.restart_seconds,
            switch_seconds=self.sc.costs.switch_seconds,
            rebalance_seconds=self.sc.costs.rebalance_seconds,
        )
        step = drive(DriverState.from_dict(self.state_doc), observed, self.spec, now, costs)
        self.state_doc = step.state.to_dict()
        if step.action is not None:
            act(step.action, SimActuator(self, now, workers))

    def record(self, d: Decision, now: float) -> None:
        record = {k: v for k, v in d.to_dict().items() if k not in ("batchSizes", "groups")}
        record["time"] = round(now, 3)
        if isinstance(d, SwitchMode) and d.groups is not None:
            record["groups"] = len(d.groups)
        self.result.decisions.append(record)

    # ------------------------------------------------------------------ run
    def run(self, bound: float) -> ModeResult:
        interval = self.spec.policy.interval_seconds
        deaths = sorted((t + self.sc.costs.failure_detect_seconds, node) for t, node in self.fleet.deaths())
        now = 0.0
        while now < self.duration:
            now = min(now + interval, self.duration)
            self._detect_deaths(now, deaths)
            self.engine.advance(now)
            if self.label == "auto" and now < self.duration:
                self._policy(now)
        r = self.result
        useful = self.counters.useful
        r.useful_samples = useful
        r.efficiency = useful / self.duration / bound if bound > 0 else 0.0
        r.final_loss = loss_after(useful, bound * self.duration)
        r.switches = len(r.decisions)
        onset = self.fleet.persistent_onset(self.spec.policy.straggler_threshold)
        if onset is not None:
            acted = [d["time"] for d in r.decisions if d["time"] >= onset]
            r.detection_delay_s = round(acted[0] - onset, 3) if acted else None
        return r


def run_mode(sc: Scenario, mode: str, bound: float | None = None) -> ModeResult:
    """Simulate `sc` in one mode; `bound` (samples/s) defaults to the fleet's."""
    return Run(sc, mode).run(bound if bound is not None else SimulatedFleet(sc).bound(sc.duration))
