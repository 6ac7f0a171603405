"""A synthetic job for policy tests: per-window counters from given speeds, decisions applied.

Faster and more controllable than the simulator: speeds are set per window, a window's work
follows the active mode's timing, and the policy's state goes through to_dict/from_dict between
calls exactly as the operator keeps it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.policy import (
    Evaluation,
    PolicyState,
    Rebalance,
    ReplaceWorker,
    Rescale,
    SwitchMode,
    WorkerSample,
    evaluate,
    job_view,
)
from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.policy.samples import GradientSignal


@dataclass
class Harness:
    speeds: list[float]
    mode: str = "auto"
    nproc: int = 1
    policy: dict[str, Any] = field(default_factory=dict)
    min_replicas: int | None = None
    noise: float = 0.0
    jitter: float = 0.0
    seed: int = 0
    comm: CommModel = field(default_factory=lambda: CommModel(latency_s=0.0, gradient_bytes=0))
    batch: int = 32
    start_mode: str | None = None
    start_batches: dict[int, int] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    # What every rank's trainer reports of its gradients (None: an older trainer, nothing measured).
    gradient: GradientSignal | None = None
    # What they report in a given mode instead, its `steps` counting the steps since the job entered
    # that mode (the trainers start their averages afresh in each mode, as gradient_stats does).
    mode_gradients: dict[str, GradientSignal] = field(default_factory=dict)
    # What every rank says of its optimizer: False when it cannot be sharded for async mode.
    async_capable: bool | None = None
    # What every rank says of hierarchical: False when it cannot run it (a script on the adaptation API).
    hierarchical_capable: bool | None = None
    adaptive_optimizer: bool | None = None
    # Seconds of every step that do not grow with the batch, by rank (speeds are then the rates of
    # the part that does); empty: steps proportional to the batch.
    fixed: list[float] = field(default_factory=list)
    # Why a change is still being applied ('' when none), as a shell tells the policy (JobView.in_flight).
    in_flight: str = ""
    # Seconds from the scrape to the evaluation: a shell's clock reads `now` after it scraped.
    evaluation_lag: float = 0.0
    # What a membership change pauses, as the shell tells the policy (the operator measures it).
    restart_seconds: float = 60.0
    shrink_seconds: float | None = None  # what a change that only removes workers pauses (None: the above)

    def __post_init__(self) -> None:
        nodes = len(self.speeds) // self.nproc
        spec: dict[str, Any] = {
            "replicas": nodes,
            "minReplicas": self.min_replicas if self.min_replicas is not None else max(1, nodes - 1),
            "maxReplicas": nodes,
            "nprocPerNode": self.nproc,
            "mode": self.mode,
            "training": {"batchSize": self.batch, **self.training},
            "policy": {"intervalSeconds": 10, "cooldownSeconds": 60, **self.policy},
        }
        self.spec = SGDJobSpec.model_validate(spec)
        self.active = self.start_mode or self.spec.initial_mode.value
        self.batches = dict(self.start_batches)
        self.groups: tuple[tuple[int, ...], ...] | None = None
        self.rng = random.Random(self.seed)
        self.now = 0.0
        self.state_doc: dict[str, Any] = PolicyState().to_dict()
        self.node_names = [f"node-{r // self.nproc}" for r in range(len(self.speeds))]
        self.counters = [[0, 0, 0.0, 0.0] for _ in self.speeds]
        self.history: list[Evaluation] = []
        self.mode_steps = 0

    @property
    def interval(self) -> float:
        return self.spec.policy.interval_seconds

    def b(self, r: int) -> int:
        return self.batches.get(r, self.batch)

    def _work(self) -> list[tuple[int, float, float]]:
        """(steps, compute, wait) of every rank over one interval in the active mode."""
        n = len(self.speeds)
        noisy = [v * (1 + self.noise * self.rng.uniform(-1, 1)) for v in self.speeds]
        c = [(self.fixed[r] if self.fixed else 0.0) + self.b(r) / noisy[r] for r in range(n)]
        if self.active == "async":
            cycle = [ci + self.comm.ps_worker_s() for ci in c]
            return [(int(self.interval / cycle[r]), c[r], cycle[r] - c[r]) for r in range(n)]
        groups = [list(g) for g in self.groups] if self.active == "hierarchical" and self.groups else [list(range(n))]
        walls = [
            max(c[r] for r in g) * (1 + self.jitter * math.log(len(g))) + self.comm.allreduce_s(len(g)) for g in groups
        ]
        wall = max(walls)  # bounded staleness: in the long run every group runs at the slowest pace
        return [(int(self.interval / wall), c[r], wall - c[r]) for r in range(n)]

    def _gradient(self) -> GradientSignal | None:
        signal = self.mode_gradients.get(self.active)
        return self.gradient if signal is None else replace(signal, steps=self.mode_steps)

    def samples(self) -> list[WorkerSample]:
        gradient = self._gradient()
        return [
            WorkerSample(
                rank=r,
                time=self.now,
                steps=k[0],
                samples=k[1],
                compute_seconds=k[2],
                comm_wait_seconds=k[3],
                mode=self.active,
                batch_size=self.b(r),
                node=self.node_names[r],
                pod=f"pod-{self.node_names[r]}",
                staleness=1.0 if self.active == "async" else 0.0,
                gradient=gradient,
                async_capable=self.async_capable,
                hierarchical_capable=self.hierarchical_capable,
                adaptive_optimizer=self.adaptive_optimizer,
            )
            for r, k in enumerate(self.counters)
        ]

    def step(self, speeds: list[float] | None = None) -> Evaluation:
        """Run one interval (at `speeds` if given), then evaluate and apply the decision."""
        if speeds is not None:
            self.speeds = list(speeds)
        if self.history:
            self.now += self.interval
            work = self._work()
            self.mode_steps += max(steps for steps, _, _ in work)
            for r, (steps, c, w) in enumerate(work):
                k = self.counters[r]
                k[0] += steps
                k[1] += steps * self.b(r)
                k[2] += steps * c
                k[3] += steps * w
        view = job_view(
            self.spec,
            mode=self.active,
            replicas=len(self.speeds) // self.nproc,
            batch_sizes=self.batches,
            groups=self.groups,
            comm=self.comm,
            in_flight=self.in_flight,
            restart_seconds=self.restart_seconds,
            shrink_seconds=self.shrink_seconds,
        )
        ev = evaluate(PolicyState.from_dict(self.state_doc), self.samples(), view, self.now + self.evaluation_lag)
        self.state_doc = ev.state.to_dict()
        self.history.append(ev)
        self._apply(ev)
        return ev

    def _apply(self, ev: Evaluation) -> None:
        d = ev.decision
        if isinstance(d, SwitchMode):
            if d.mode != self.active:
                self.mode_steps = 0
            self.active = d.mode
            self.groups = d.groups
            if d.batch_sizes is not None:
                self.batches = dict(d.batch_sizes)
        elif isinstance(d, Rebalance):
            self.batches = dict(d.batch_sizes)
        elif isinstance(d, ReplaceWorker):
            node = self.node_names[d.rank]
            healthy = sorted(v for r, v in enumerate(self.speeds) if self.node_names[r] != node)
            for r, name in enumerate(self.node_names):
                if name == node:
                    self.node_names[r] = f"{name}-new"
                    self.speeds[r] = healthy[len(healthy) // 2]
            self._restart()
        elif isinstance(d, Rescale):
            keep = [r for r in range(len(self.speeds)) if r not in d.remove_ranks]
            typical = sorted(self.speeds)[len(self.speeds) // 2]
            self.speeds = [self.speeds[r] for r in keep]
            self.node_names = [self.node_names[r] for r in keep]
            for k in range(d.replicas - len(self.speeds) // self.nproc):  # a grown job gets fresh nodes
                self.speeds += [typical] * self.nproc
                self.node_names += [f"node-grown-{self.now:g}-{k}"] * self.nproc
            self.batches = {}
            self._restart()

    def _restart(self) -> None:
        """A membership change restarts every process: counters start from zero."""
        self.counters = [[0, 0, 0.0, 0.0] for _ in self.speeds]

    def changes(self) -> list[Evaluation]:
        return [e for e in self.history if e.decision.action != "keep"]


def test_harness_sync_work_follows_the_slowest_rank() -> None:
    h = Harness([100.0, 100.0, 50.0], mode="sync")
    h.step()
    h.step()
    steps = {k[0] for k in h.counters}
    assert steps == {int(10 / (32 / 50))}  # every rank steps at the slow rank's pace
    assert h.counters[2][3] == 0.0 and h.counters[0][3] > 0  # only the fast ranks wait


def test_harness_async_ranks_step_at_their_own_pace() -> None:
    h = Harness([100.0, 50.0], mode="async", start_mode="async")
    h.step()
    h.step()
    assert h.counters[0][0] == 2 * h.counters[1][0] or abs(h.counters[0][0] - 2 * h.counters[1][0]) <= 1
