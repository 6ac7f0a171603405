"""The three shells (operator, `sgdjob run`, simulator) make the same decisions for the same scrapes."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sgdjob_operator.api.models import JobMode, SGDJob, SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.actuator import apply_step, evaluate_job, take_policy_state
from sgdjob_operator.k8s.observe import Observation, command_to_push, record_observation
from sgdjob_operator.k8s.status import controller, dump_status, load_status, parse_time
from sgdjob_operator.local.auto import AutoController
from sgdjob_operator.local.progress import PlainDisplay, ProgressFrame
from sgdjob_operator.policy import WorkerSample
from sgdjob_operator.sim.scenario import load_scenario
from sgdjob_operator.sim.simulation import Run
from sgdjob_operator.workers.scrape import ControlResult, Endpoint, ScrapeResult
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.worker_status import WorkerStatus
from tests.unit.policy_feed import INTERVAL, STRAGGLER, Scrapes, feed, spec_for

Decisions = list[tuple[float, str, str]]


LOCAL_ENDPOINTS = [Endpoint(f"http://127.0.0.1:{9000 + r}") for r in range(4)]
SHIFTING = [STRAGGLER] * 7 + [[100.0] * 4] * 8  # a straggler, rebalanced; then it recovers


@dataclass
class FakeFleet:
    names: list[str]
    next_index: int = 4

    def nodes(self) -> list[str]:
        return list(self.names)

    def world_size(self) -> int:
        return len(self.names)


@dataclass
class FakeRun:
    fleet: FakeFleet = field(default_factory=lambda: FakeFleet([f"node-{r}" for r in range(4)]))
    report_extra: dict[str, Any] = field(default_factory=dict)
    pushed: list[ControlCommand] = field(default_factory=list)
    applied: int = 0
    polls_asked: list[float] = field(default_factory=list)

    def poll_within(self, seconds: float) -> None:
        self.polls_asked.append(seconds)

    async def push(self, command: ControlCommand) -> ControlResult:
        self.pushed.append(command)
        self.applied = command.epoch  # the workers apply it at once
        return ControlResult(200)

    async def replace(self, node: str, mode: SyncMode, reason: str) -> None:
        raise AssertionError("no membership change expected")

    async def rescale(self, nodes: int, mode: SyncMode, reason: str, remove: tuple[str, ...] = ()) -> None:
        raise AssertionError("no membership change expected")


def kubernetes_shell(spec: SGDJobSpec, scrapes: Scrapes) -> tuple[Decisions, list[ControlCommand]]:
    """The operator's monitor pass, with status and the policy-state ConfigMap written out and read
    back between passes."""
    st, applied, pushed = SGDJobStatus(mode="sync", target_mode="sync"), 0, []
    policy: str | None = None
    for t, samples in scrapes:
        st = load_status(json.loads(json.dumps(dump_status(st))))  # a restarted operator sees only this
        controller(st).policy_state = policy  # and the job's ConfigMap
        obs = Observation(t, tuple(samples), {}, Endpoint("http://10.0.0.1:9400"), control_epoch=applied)
        step, problem = evaluate_job(spec, st, obs, t, busy="")
        assert problem == ""
        record_observation(st, obs, step.health)
        apply_step(st, step, t, spec)
        command = command_to_push(st, obs)
        if command is not None:
            pushed.append(command)
            applied = command.epoch
        policy = take_policy_state(st)
    return [(parse_time(d.time) or 0.0, d.action, d.reason) for d in st.decisions], pushed


def local_shell(spec: SGDJobSpec, scrapes: Scrapes) -> tuple[Decisions, list[ControlCommand]]:
    """`sgdjob run`'s auto controller on a run whose workers apply every command at once."""
    now = [0.0]
    auto = AutoController(SGDJob(spec=spec), PlainDisplay(stream=io.StringIO()), clock=lambda: now[0])
    run = FakeRun()
    for t, samples in scrapes:
        now[0] = t
        results = [
            ScrapeResult(LOCAL_ENDPOINTS[s.rank], t, s, WorkerStatus(rank=s.rank, control_epoch=run.applied))
            for s in samples
        ]
        asyncio.run(auto(run, results, ProgressFrame(time=t, elapsed_s=t)))
    return [(d["time_s"], d["action"], d["reason"]) for d in auto.decisions], run.pushed


def simulator_shell(tmp_path: Path, scrapes: Scrapes) -> tuple[Decisions, list[int], SGDJobSpec]:
    """The simulator's auto mode, fed the same scrapes instead of its own counters."""
    scenario = {
        "name": "same-inputs",
        "nprocPerNode": 1,
        "fleet": [{"name": "gpu", "nodes": 4, "speed": 100, "maxBatch": 128}],
        "durationSeconds": 1000,
        "network": {"latencySeconds": 2e-5, "bandwidthGbps": 12.5, "gradientMb": 0, "psApplySeconds": 5e-4},
        "costs": {"restartSeconds": 60, "switchSeconds": 5},
        "job": {
            "training": {"batchSize": 32},
            "policy": {
                "intervalSeconds": INTERVAL,
                "persistenceIntervals": 3,
                "cooldownSeconds": 60,
                "allowedActions": ["rebalance"],
            },
        },
    }
    path = tmp_path / "same-inputs.yaml"
    path.write_text(json.dumps(scenario))
    fed = dict(scrapes)

    class Fed(Run):
        def _samples(self, now: float, workers: list[int]) -> list[WorkerSample]:
            return fed[now]

    run = Fed(load_scenario(path), "auto")
    for t, _ in scrapes:
        run._policy(t)
    decisions = [(d["time"], d["action"], d["reason"]) for d in run.result.decisions]
    return decisions, [int(b) for b in run.batches], run.spec


def test_the_three_shells_make_the_same_decisions_for_the_same_scrapes(tmp_path: Path) -> None:
    scrapes = feed(SHIFTING)
    sim, batches, spec = simulator_shell(tmp_path, scrapes)
    assert spec.mode is JobMode.AUTO
    k8s, k8s_pushed = kubernetes_shell(spec, scrapes)
    local, local_pushed = local_shell(spec, scrapes)
    assert [(t, a) for t, a, _ in k8s] == [(30.0, "rebalance"), (90.0, "rebalance")], k8s
    assert k8s == local == sim
    # The same commands reach rank 0, and the simulated workers run what they say.
    assert [c.model_dump() for c in k8s_pushed] == [c.model_dump() for c in local_pushed]
    assert [c.epoch for c in k8s_pushed] == [1, 2]
    assert k8s_pushed[-1].batch_sizes == dict(enumerate(batches)) == {r: 32 for r in range(4)}


def test_workers_that_date_their_training_start_get_decisions_one_interval_sooner_in_every_shell(
    tmp_path: Path,
) -> None:
    # Training begins at t=0 and the first look comes an interval later: with the start dated, that
    # look already has a rate, so persistence (3) is met at 30 s instead of 40 s, in all three shells.
    undated = feed(SHIFTING)[1:]
    dated = [(t, [dataclasses.replace(s, training_seconds=t) for s in samples]) for t, samples in undated]
    for scrapes, first in ((undated, 40.0), (dated, 30.0)):
        sim, _, spec = simulator_shell(tmp_path, scrapes)
        k8s, _ = kubernetes_shell(spec, scrapes)
        local, _ = local_shell(spec, scrapes)
        assert k8s == local == sim and k8s[0][:2] == (first, "rebalance"), k8s


def sync_job_at(t: float, began: float | None, batch: int = 32) -> list[WorkerSample]:
    """A synchronous job of STRAGGLER's speeds that began training at t=0, scraped at `t`; it dates
    its start when `began` is set (the first step is under way from 0, as in the trainer)."""
    cost = [batch / v for v in STRAGGLER]
    wall = max(cost) + 0.01
    steps = math.floor(t / wall)
    return [
        WorkerSample(
            rank=r,
            time=t,
            steps=steps,
            samples=steps * batch,
            compute_seconds=steps * cost[r],
            comm_wait_seconds=steps * (wall - cost[r]),
            mode="sync",
            batch_size=batch,
            node=f"node-{r}",
            world_size=len(STRAGGLER),
            training_seconds=None if began is None else t - began,
        )
        for r in range(len(STRAGGLER))
    ]


def test_the_local_controller_acts_within_persistence_intervals_of_the_training_start() -> None:
    # Polls every 1.05 s (a second's wait plus the scrape) from just after the training start, as
    # `sgdjob run` polls; a 2 s interval
    # and persistence 2, as examples/quickstart.yaml: the straggler is acted on within 4 s.
    spec = spec_for(policy={"intervalSeconds": 2, "persistenceIntervals": 2, "allowedActions": ["rebalance"]})
    bound = spec.policy.persistence_intervals * spec.policy.interval_seconds
    firsts = []
    now = [0.0]
    for began in (0.0, None):
        auto = AutoController(SGDJob(spec=spec), PlainDisplay(stream=io.StringIO()), clock=lambda: now[0])
        run = FakeRun()
        for poll in range(12):
            now[0] = t = 0.3 + 1.05 * poll
            results = [
                ScrapeResult(LOCAL_ENDPOINTS[s.rank], t, s, WorkerStatus(rank=s.rank, control_epoch=run.applied))
                for s in sync_job_at(t, began)
            ]
            asyncio.run(auto(run, results, ProgressFrame(time=t, elapsed_s=t)))
        firsts.append(auto.decisions[0]["time_s"])
    dated, undated = firsts
    assert dated <= bound < undated, firsts
    assert undated == pytest.approx(dated + 1.05)  # the undated run spends its first poll on a baseline


@dataclass
class GrowingRun(FakeRun):
    """A local run that lost a node: three agents where the spec asks for four."""

    fleet: FakeFleet = field(default_factory=lambda: FakeFleet([f"node-{r}" for r in range(3)]))
    rescales: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)

    async def rescale(self, nodes: int, mode: SyncMode, reason: str, remove: tuple[str, ...] = ()) -> None:
        self.rescales.append((nodes, remove))


def test_a_healthy_job_below_its_replicas_grows_back_the_same_in_the_operator_and_locally() -> None:
    scrapes = feed([[100.0] * 3] * 6)
    policy = {"allowedActions": ["rescale"]}
    # Locally the spec keeps replicas 4 and the run has 3 agents.
    auto = AutoController(SGDJob(spec=spec_for(policy=policy)), PlainDisplay(stream=io.StringIO()))
    run = GrowingRun()
    for t, samples in scrapes:
        auto.clock = lambda t=t: t
        results = [ScrapeResult(LOCAL_ENDPOINTS[s.rank], t, s, WorkerStatus(rank=s.rank)) for s in samples]
        asyncio.run(auto(run, results, ProgressFrame(time=t, elapsed_s=t)))
    assert run.rescales == [(4, ())]
    local = [(d["time_s"], d["action"], d["reason"]) for d in auto.decisions]
    # The operator's own shrink lowered spec.replicas to 3 and kept the user's 4 in status.
    spec3 = spec_for(replicas=3, policy=policy)
    st = SGDJobStatus.model_validate({"mode": "sync", "controller": {"goalReplicas": 4, "scaledReplicas": 3}})
    k8s = []
    for t, samples in scrapes:
        obs = Observation(t, tuple(samples), {})
        step, _ = evaluate_job(spec3, st, obs, t, busy="")
        out = apply_step(st, step, t, spec3)
        k8s += [(t, step.decision.action, step.decision.reason)] if out.applied else []
        assert out.scale_to in (None, 4)
    assert local == k8s and [a for _, a, _ in k8s] == ["rescale"], k8s
    assert "grow to 4 nodes" in k8s[0][2]


@dataclass
class ShrinkingRun(FakeRun):
    """A local run whose rescale waits for the leaving agent to exit (`retire_s` of the controller's
    clock), as `sgdjob run`'s does, while the survivors re-form their world."""

    clock: list[float] = field(default_factory=lambda: [0.0])
    retire_s: float = 6.0

    async def rescale(self, nodes: int, mode: SyncMode, reason: str, remove: tuple[str, ...] = ()) -> None:
        self.clock[0] += self.retire_s
        self.fleet = FakeFleet(self.fleet.names[:nodes])


def test_a_local_shrink_is_measured_from_its_decision_though_the_survivors_train_before_it_returns() -> None:
    # Run under load in CI, the survivors trained again 2 s into a rescale whose retired agent took 6 s
    # to exit; dated from the rescale's return, that start was "before the change" and never measured.
    run = ShrinkingRun()
    auto = AutoController(
        SGDJob(spec=spec_for(policy={"allowedActions": ["rescale"]})),
        PlainDisplay(stream=io.StringIO()),
        clock=lambda: run.clock[0],
    )
    decided: float | None = None
    for t, samples in feed([[100.0, 100.0, 100.0, 25.0]] * 8):
        if decided is not None:
            break
        run.clock[0] = t
        dated = [dataclasses.replace(s, training_seconds=t - 1.0) for s in samples]  # trained since 1.0
        results = [ScrapeResult(LOCAL_ENDPOINTS[s.rank], t, s, WorkerStatus(rank=s.rank)) for s in dated]
        asyncio.run(auto(run, results, ProgressFrame(time=t, elapsed_s=t)))
        decided = next((d["time_s"] for d in auto.decisions if d["action"] == "rescale"), None)
    assert decided is not None and run.fleet.world_size() == 3, auto.decisions
    t = decided + 10.0
    run.clock[0] = t
    survivors = [
        WorkerSample(
            rank=r, time=t, steps=10, samples=320, compute_seconds=1.0, comm_wait_seconds=0.1, mode="sync",
            batch_size=32, world_size=3, training_seconds=t - (decided + 2.0),
        )
        for r in range(3)
    ]  # fmt: skip
    results = [ScrapeResult(LOCAL_ENDPOINTS[s.rank], t, s, WorkerStatus(rank=s.rank)) for s in survivors]
    asyncio.run(auto(run, results, ProgressFrame(time=t, elapsed_s=t)))
    assert run.report_extra["restarts_measured"] == [
        {"from": "launch", "seconds": 1.0},
        {"from": "shrink", "seconds": 2.0},
    ]
