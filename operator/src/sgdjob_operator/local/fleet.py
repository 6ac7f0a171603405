"""Membership of a local run: which agents (emulated nodes) run now, and the changes the policy
asks for, replacing a worker and rescaling within min/max, carried out on this machine.

`plan_replace`/`plan_rescale` are pure: which nodes leave, which new agent indices join. `Fleet`
carries a change out: it retires the leaving agents (SIGTERM first, so their trainers stop at an
agreed step with a final checkpoint; torchrun then restarts the remaining workers from it) and
starts the new ones under fresh node names (local-N, never reused), which join the next
rendezvous round. A replacement thus lands on a "new node": an emulated node-bound slowdown stays
behind with the old name, as a slow machine would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sgdjob_operator.local.launch import LOOPBACK, AgentPlan, LaunchPlan, plan_agent, write_run_config
from sgdjob_operator.local.procs import Agent, ProcessSet, free_port_blocks
from sgdjob_operator.workers.scrape import Endpoint
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.launch_contract import ENV_AGENT_ID


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """Nodes to stop and agent indices to start; `nodes` is how many agents run afterwards."""

    retire: tuple[str, ...]
    add: tuple[int, ...]
    nodes: int


def plan_replace(active: Sequence[str], node: str, next_index: int) -> MembershipChange:
    """Stop `node`, start one new agent in its place."""
    if node not in active:
        raise ValueError(f"node {node!r} is not running (running: {', '.join(active)})")
    return MembershipChange((node,), (next_index,), len(active))


def plan_rescale(active: Sequence[str], target: int, remove: Sequence[str], next_index: int) -> MembershipChange:
    """Run `target` agents: to shrink, the nodes named in `remove` leave first, then the newest;
    to grow, new agents join under new names."""
    if target < 1:
        raise ValueError(f"a run needs at least one node, not {target}")
    if target >= len(active):
        return MembershipChange((), tuple(range(next_index, next_index + target - len(active))), target)
    leaving = [n for n in remove if n in active][: len(active) - target]
    for node in reversed(active):
        if len(leaving) == len(active) - target:
            break
        if node not in leaving:
            leaving.append(node)
    return MembershipChange(tuple(leaving), (), target)


@dataclass
class Fleet:
    """The agents of a run, changed while it runs. `history` goes into report.json."""

    plan: LaunchPlan
    procs: ProcessSet[AgentPlan]
    retire_grace_s: float = 10.0
    next_index: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    # Tells the rendezvous store how many nodes the run wants (`store_probe.store_answers(nodes=)`),
    # so the agents' next round completes at that size; None: nobody is told (torch's last call).
    tell_store: Callable[..., Awaitable[bool]] | None = None

    async def tell(self, nodes: int | None = None, departed: Sequence[str] = ()) -> bool:
        """Tell the store the intended size (`nodes`, else the nodes running now) and the agents about
        to be retired on purpose (their peers drop them from the rendezvous without their heartbeats)."""
        if self.tell_store is None:
            return False
        return await self.tell_store(nodes=len(self.nodes()) if nodes is None else nodes, departed=tuple(departed))

    def __post_init__(self) -> None:
        self.next_index = max((a.index for a in self.plan.agents), default=-1) + 1

    def active(self) -> list[Agent[AgentPlan]]:
        return [a for a in self.procs.agents if not a.retired]

    def nodes(self) -> list[str]:
        return [a.plan.node for a in self.active()]

    def world_size(self) -> int:
        return sum(len(a.plan.metrics_ports) for a in self.active())

    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(
            Endpoint(f"http://{LOOPBACK}:{port}", node=a.plan.node)
            for a in self.active()
            for port in a.plan.metrics_ports
        )

    def start(self, indices: Sequence[int], mode: SyncMode, *, attempt: int = 0) -> list[str]:
        """Start agents `indices` (node local-<index>); `attempt` > 0 restarts a node that died,
        writing to a log of its own so the dead agent's log is kept."""
        if not indices:
            return []
        bases = free_port_blocks(len(indices), self.plan.context.job.spec.nproc_per_node)
        plans = [plan_agent(self.plan.context, index, mode, base) for index, base in zip(indices, bases, strict=True)]
        if attempt:
            plans = [
                replace(
                    p,
                    log_path=p.log_path.with_name(f"{p.node}.restart-{attempt}.log"),
                    env={**p.env, ENV_AGENT_ID: f"{p.node}.{attempt}"},  # another agent for the rendezvous
                )
                for p in plans
            ]
        for p in plans:
            write_run_config(p)
        self.procs.start(plans)
        self.next_index = max(self.next_index, max(indices) + 1)
        return [p.node for p in plans]

    async def apply(
        self, change: MembershipChange, mode: SyncMode, *, action: str, reason: str, elapsed_s: float
    ) -> None:
        """Retire the leaving agents (in a worker thread: it waits for them), then start the new ones."""
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        # A retired node without an active agent has lost it already (a crash loop's node).
        leaving = [a for a in self.active() if a.plan.node in change.retire]
        # Before anyone leaves: the survivors' round completes at that size, without the leavers.
        await self.tell(change.nodes, [a.plan.env[ENV_AGENT_ID] for a in leaving])
        for agent in leaving:
            await loop.run_in_executor(None, self.procs.retire, agent, self.retire_grace_s)
        added = self.start(change.add, mode)
        self.history.append(
            {
                "time_s": round(elapsed_s, 3),
                "action": action,
                "reason": reason,
                "retired": list(change.retire),
                "added": added,
                "nodes": self.nodes(),
                "retire_s": round(time.monotonic() - began, 3),
            }
        )
