"""What the local runner does when a node's agent dies without being asked to: the decision is a
pure function of the deaths so far, as a cluster's would be of its pod failures.

A node is an agent process locally, so a dead agent is a lost node. Every death counts against
`runPolicy.backoffLimit` (as a failed worker pod does on a cluster: more deaths than the limit fail
the job). Within the budget the node's agent is started again under the same name after a backoff
that doubles with each of its deaths (1 s, 2 s, 4 s ... capped); a node that dies `crash_loop_deaths`
times within `crash_loop_window_s` is in a crash loop, as a broken machine would be, and is replaced
by an agent under a new node name instead. Meanwhile the surviving agents go on: torchrun's elastic
rendezvous re-forms their world (at least minReplicas nodes) from the last checkpoint.

The rendezvous store is no node of the job but infrastructure: when its process dies it is started
again on the same port (`decide_store`), and agents that die of its loss (within
`STORE_LOSS_WINDOW_S` of it) are restarted without charge to backoffLimit or to their crash-loop
count, as a cluster does not count a pod evicted by a lost node against the job. So is an agent
that exits `EXIT_RENDEZVOUS_TIMEOUT`: fewer than minReplicas agents joined its rendezvous in time,
its peers missing, not broken (one that crashes dies with its own exit code, which counts).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_TIMEOUT


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_limit: int
    min_nodes: int
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    crash_loop_deaths: int = 3
    crash_loop_window_s: float = 120.0


@dataclass(frozen=True, slots=True)
class Death:
    """One agent that exited unexpectedly, `time_s` seconds into the run."""

    node: str
    time_s: float
    exit_code: int
    infrastructure: bool = False  # died of a lost rendezvous store or missing peers: not the job's fault


# An agent that dies this soon after the store did died of its loss (its rendezvous calls fail
# within torch's store timeouts, tens of seconds; its workers' restarts take a few more).
STORE_LOSS_WINDOW_S = 90.0
# More store deaths than this within STORE_CRASH_WINDOW_S: the store cannot stay up (its port is
# taken, the machine is out of memory); restarting it again would only hide that.
STORE_CRASH_DEATHS = 5
STORE_CRASH_WINDOW_S = 120.0


def caused_by_store(time_s: float, store_deaths_s: Sequence[float], window_s: float = STORE_LOSS_WINDOW_S) -> bool:
    """Whether an agent death at `time_s` follows a store death (times in `store_deaths_s`)."""
    return any(0.0 <= time_s - t <= window_s for t in store_deaths_s)


def decide_store(store_deaths_s: Sequence[float], exit_code: int) -> Verdict:
    """What to do about the rendezvous store's last death (all its death times so far, oldest
    first): start it again at once, on the same port, unless it keeps dying."""
    last = store_deaths_s[-1]
    what = f"rendezvous store died ({describe_exit(exit_code)})"
    recent = [t for t in store_deaths_s if last - t <= STORE_CRASH_WINDOW_S]
    if len(recent) > STORE_CRASH_DEATHS:
        return Verdict(
            "fail",
            f"{what}: {len(recent)} store deaths within {STORE_CRASH_WINDOW_S:.0f}s; "
            "see the store's log (logs/rendezvous*.log) for why it does not stay up",
        )
    return Verdict(
        "restart",
        f"{what}; restarting it on the same port; agents that lose it are restarted "
        "without charge to runPolicy.backoffLimit (an infrastructure fault)",
    )


@dataclass(frozen=True, slots=True)
class Verdict:
    """restart: the same node after `delay_s`; replace: a new node now; fail: the job fails."""

    action: Literal["restart", "replace", "fail"]
    reason: str
    delay_s: float = 0.0


def describe_exit(code: int) -> str:
    """`killed by SIGKILL` for a negative return code, `exit code 1` otherwise (pure)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def backoff(policy: RestartPolicy, deaths_of_node: int) -> float:
    """Seconds to wait before the node's agent starts again after its `deaths_of_node`-th death."""
    return float(min(policy.max_backoff_s, policy.backoff_s * 2 ** max(0, deaths_of_node - 1)))


def decide(policy: RestartPolicy, deaths: Sequence[Death], live: int) -> Verdict:
    """What to do about the last of `deaths` (all deaths of the run so far, oldest first), with
    `live` agents still running besides the dead one's node."""
    last = deaths[-1]
    what = f"agent {last.node} died ({describe_exit(last.exit_code)})"
    going_on = "the others go on" if live >= policy.min_nodes else f"the others wait for minReplicas {policy.min_nodes}"
    if last.infrastructure:
        delay = policy.backoff_s
        of = (
            "of a rendezvous fewer than minReplicas agents joined in time"
            if last.exit_code == EXIT_RENDEZVOUS_TIMEOUT
            else "of the lost rendezvous store"
        )
        return Verdict(
            "restart",
            f"{what} {of}; restarting it in {delay:g}s, not counted against runPolicy.backoffLimit",
            delay,
        )
    counted = [d for d in deaths if not d.infrastructure]
    if len(counted) > policy.backoff_limit:
        return Verdict(
            "fail",
            f"{what}: {len(counted)} agent deaths exceed runPolicy.backoffLimit {policy.backoff_limit}; "
            "raise spec.runPolicy.backoffLimit to allow more restarts",
        )
    mine = [d for d in counted if d.node == last.node]
    recent = [d for d in mine if last.time_s - d.time_s <= policy.crash_loop_window_s]
    budget = f"death {len(counted)} of backoffLimit {policy.backoff_limit}"
    if len(recent) >= policy.crash_loop_deaths:
        return Verdict(
            "replace",
            f"{what}; crash loop: {len(recent)} deaths within {policy.crash_loop_window_s:.0f}s, "
            f"the node is excluded and replaced ({budget})",
        )
    delay = backoff(policy, len(mine))
    return Verdict("restart", f"{what}; restarting it in {delay:g}s, {going_on} ({budget})", delay)
