"""The local runner's handling of agents that die (lost nodes): each poll, `Reviver.check` finds the
agents that exited unexpectedly, asks `deaths.decide` what to do, and carries it out: a restart of
the same node after its backoff, a replacement under a new node name for a crash loop, or the
job's failure. Each death goes to report.json (`agent_deaths`) with the figures the chaos suite
reads: the step the job had reached, the last checkpoint, the steps lost, when the agent came back
and how long the job took to regain the step it had reached (`recovery_s`).

The rendezvous store's process is watched too: when it exits it is started again on the same port
(the agents' --rdzv-endpoint stays true), its death goes to report.json (`store_deaths`, same
figures), and the agents that die of its loss are restarted without charge to backoffLimit, as are
agents whose rendezvous timed out for want of peers (`EXIT_RENDEZVOUS_TIMEOUT`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from sgdjob_operator.local.deaths import (
    Death,
    RestartPolicy,
    Verdict,
    caused_by_store,
    decide,
    decide_store,
    describe_exit,
)
from sgdjob_operator.local.fleet import Fleet, MembershipChange
from sgdjob_operator.local.launch import AgentPlan
from sgdjob_operator.local.procs import Agent, ProcId
from sgdjob_operator.local.progress import Display
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_CLOSED, EXIT_RENDEZVOUS_TIMEOUT
from sgdjob_trainer.wire.worker_status import WorkerStatus

# A dead agent is judged this long after its exit is seen: when the job ends, an agent that came
# back too late exits (its rendezvous is closed) moments before the others, which are finishing.
DEATH_SETTLE_S = 2.0


class Run(Protocol):
    """What the reviver needs of a running job (`runner.LocalRun` is one)."""

    @property
    def fleet(self) -> Fleet: ...

    @property
    def started(self) -> float: ...

    @property
    def last_status(self) -> dict[int, WorkerStatus]: ...

    def world_changed(self) -> None: ...


def last_checkpoint(root: Path | None) -> int | None:
    """The newest step with a complete checkpoint under `root` (the trainer's step-NNN/COMPLETE)."""
    if root is None:
        return None
    steps = [int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/COMPLETE")]
    return max(steps, default=None)


def job_step(statuses: Sequence[WorkerStatus]) -> int:
    return max((s.step for s in statuses), default=0)


@dataclass
class Pending:
    """A dead node's agent waiting for its backoff to pass."""

    index: int
    due: float
    attempt: int
    record: dict[str, Any]


@dataclass
class Reviver:
    policy: RestartPolicy
    display: Display
    checkpoint_dir: Path | None
    clock: Callable[[], float] = time.monotonic
    deaths: list[Death] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)  # report.json's agent_deaths
    pending: list[Pending] = field(default_factory=list)
    failure: str = ""  # why the job fails, once it does
    restarts: dict[str, int] = field(default_factory=dict)  # by node
    revived: set[ProcId] = field(default_factory=set)  # the agents started in place of dead ones
    seen_dead: dict[ProcId, float] = field(default_factory=dict)
    store_records: list[dict[str, Any]] = field(default_factory=list)  # report.json's store_deaths

    def _dead(self, fleet: Fleet) -> list[Agent[AgentPlan]]:
        return [a for a in fleet.active() if a.returncode not in (0, None)]

    def awaiting(self, fleet: Fleet) -> bool:
        """A death is still to be judged (within DEATH_SETTLE_S): the run must not end before it is,
        though no agent runs (the store's loss kills every agent at once)."""
        return not self.failure and not self.finishing(fleet) and bool(self._dead(fleet))

    def finishing(self, fleet: Fleet) -> bool:
        """An agent has finished: its workers reached the end, so the job is ending, not recovering."""
        return any(a.returncode == 0 for a in fleet.active())

    async def check(self, run: Run, mode: SyncMode) -> None:
        """Handle new deaths, start the agents whose backoff has passed, update recovery figures."""
        if self.failure:
            return
        now = self.clock()
        elapsed = now - run.started
        self._recovered(run, elapsed)
        self._check_store(run, elapsed)
        if self.failure:
            return
        if self.finishing(run.fleet):
            self._finish(run.fleet, elapsed)
            return
        dead = self._dead(run.fleet)
        for agent in dead:
            self.seen_dead.setdefault(agent.id, now)
        # Oldest first; of deaths seen together, one by a signal (a lost node) before exits with a code
        # (the survivors whose torchrun restarts it exhausted): the cause before its consequences.
        dead.sort(key=lambda a: (self.seen_dead[a.id], (a.returncode or 0) >= 0))
        for agent in dead:
            if now - self.seen_dead[agent.id] < DEATH_SETTLE_S:
                continue
            await self._died(run, agent, mode, elapsed)
            if self.failure:
                return
        for p in [p for p in self.pending if p.due <= now]:
            self.pending.remove(p)
            self._started(run.fleet, run.fleet.start([p.index], mode, attempt=p.attempt))
            p.record["restarted_s"] = round(elapsed, 3)
            self.display.note(f"[{elapsed:6.1f}s] agent {p.record['node']} restarted (restart {p.attempt})")
            run.world_changed()

    def _check_store(self, run: Run, elapsed: float) -> None:
        """Start the rendezvous store again, on the same port, if its process has exited."""
        procs = run.fleet.procs
        if not procs.services or procs.services[-1].returncode is None:
            return
        code = procs.services[-1].returncode or 0
        verdict = decide_store([r["time_s"] for r in self.store_records] + [elapsed], code)
        record = self._record(run, "rendezvous", elapsed, code, verdict)
        self.store_records.append(record)
        self.display.note(f"[{elapsed:6.1f}s] {verdict.reason}")
        if verdict.action == "fail":
            self.failure = verdict.reason
            return
        plan = run.fleet.plan.store
        n = len(procs.services)
        procs.start_service(replace(plan, log_path=plan.log_path.with_name(f"rendezvous.restart-{n}.log")))
        record["restarted_s"] = round(self.clock() - run.started, 3)

    def _record(self, run: Run, node: str, elapsed: float, code: int, verdict: Verdict) -> dict[str, Any]:
        checkpoint = last_checkpoint(self.checkpoint_dir)
        # The last poll's step may lag a checkpoint written since: the job had reached at least that.
        step = max(job_step(list(run.last_status.values())), checkpoint or 0)
        return {
            "node": node,
            "time_s": round(elapsed, 3),
            "exit": describe_exit(code),
            "exit_code": code,
            "step": step,
            "checkpoint_step": checkpoint,
            "lost_steps": step - (checkpoint or 0),
            "action": verdict.action,
            "reason": verdict.reason,
            "recovery_s": None,
        }

    def _started(self, fleet: Fleet, nodes: Sequence[str]) -> None:
        self.revived |= {a.id for a in fleet.active() if a.plan.node in nodes}

    def _finish(self, fleet: Fleet, elapsed: float) -> None:
        """The others finished the job: no restart is due any more, and an agent that came back too
        late for their last round, or joined (grown by the policy) after it, is left out, not failed:
        it finds the rendezvous closed. A death among the agents that trained to the end still fails
        the job (see the runner)."""
        for p in self.pending:
            p.record["note"] = "not restarted: the other agents finished the job"
        self.pending = []
        for agent in self._dead(fleet):
            if agent.id in self.revived or agent.returncode == EXIT_RENDEZVOUS_CLOSED:
                agent.retired = True
                self.display.note(
                    f"[{elapsed:6.1f}s] agent {agent.plan.node} came back after the job's last round "
                    f"({describe_exit(agent.returncode or 0)}); left out"
                )

    async def _died(self, run: Run, agent: Agent[AgentPlan], mode: SyncMode, elapsed: float) -> None:
        node, code = agent.plan.node, agent.returncode or 0
        # Judged by when its exit was seen: the store's death is seen at the same poll or before.
        seen = self.seen_dead[agent.id] - run.started
        # Or of missing peers: its rendezvous timed out (deaths.py: not counted either).
        infra = caused_by_store(seen, [r["time_s"] for r in self.store_records]) or code == EXIT_RENDEZVOUS_TIMEOUT
        self.deaths.append(Death(node, elapsed, code, infrastructure=infra))
        live = len([a for a in run.fleet.active() if a.returncode is None])
        verdict = decide(self.policy, self.deaths, live)
        record = self._record(run, node, elapsed, code, verdict)
        record["infrastructure"] = infra
        self.records.append(record)
        self.display.note(f"[{elapsed:6.1f}s] {verdict.reason}")
        if verdict.action == "fail":
            self.failure = verdict.reason
            return
        agent.retired = True  # no longer a member: its node comes back as a new agent
        run.world_changed()
        await self._carry_out(run, agent.plan, verdict, mode, record)

    async def _carry_out(
        self, run: Run, plan: AgentPlan, verdict: Verdict, mode: SyncMode, record: dict[str, Any]
    ) -> None:
        node, elapsed = plan.node, record["time_s"]
        if verdict.action == "restart":
            self.restarts[node] = self.restarts.get(node, 0) + 1
            record["backoff_s"] = verdict.delay_s
            record["restarted_s"] = None
            self.pending.append(Pending(plan.index, self.clock() + verdict.delay_s, self.restarts[node], record))
            return
        for p in [p for p in self.pending if p.record["node"] == node]:
            self.pending.remove(p)  # a replaced node is not restarted as well
        fleet = run.fleet
        new = f"local-{fleet.next_index}"
        change = MembershipChange((node,), (fleet.next_index,), len(fleet.nodes()) + 1)
        await fleet.apply(change, mode, action="replaceNode", reason=verdict.reason, elapsed_s=elapsed)
        self._started(fleet, [new])
        record["replaced_by"] = new
        record["restarted_s"] = round(self.clock() - run.started, 3)
        self.display.note(f"[{elapsed:6.1f}s] node {node} excluded; agent {new} started in its place")

    def _recovered(self, run: Run, elapsed: float) -> None:
        """A death is recovered from once the job's step is back beyond where it was at the death."""
        step = job_step(list(run.last_status.values()))
        for record in [*self.records, *self.store_records]:
            if record["recovery_s"] is None and record["action"] != "fail" and step > record["step"]:
                record["recovery_s"] = round(elapsed - record["time_s"], 3)

    def report(self) -> dict[str, Any]:
        restarted = sum(1 for r in self.records if r.get("restarted_s") is not None and r["action"] == "restart")
        return {
            **({"store_deaths": self.store_records} if self.store_records else {}),
            "agent_deaths": self.records,
            "agent_restarts": restarted,
            "nodes_replaced": [r["node"] for r in self.records if r["action"] == "replace"],
        }
