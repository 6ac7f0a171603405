"""What the local runner does when a node's agent dies without being asked to: the decision is a
pure function of the deaths so far, as a cluster's would be of its pod failures.

A node is an agent process locally, so a dead agent is a lost node. Every death counts against
`runPolicy.backoffLimit` (as a failed worker pod does on a cluster: more deaths than the limit fail
the job). Within the budget the node's agent is started again under the same name after a backoff
that doubles with each of its deaths (1 s, 2 s, 4 s ... capped); a node that dies `crash_loop_deaths`
times within `crash_loop_window_s` is in a crash loop, as a broken machine would be, and is replaced
by an agent under a new node name instead. Meanwhile the surviving agents go on: torchrun's elastic
rendezvous re-forms their world (at least minReplicas nodes) from the last checkpoint.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


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
    if len(deaths) > policy.backoff_limit:
        return Verdict(
            "fail",
            f"{what}: {len(deaths)} agent deaths exceed runPolicy.backoffLimit {policy.backoff_limit}; "
            "raise spec.runPolicy.backoffLimit to allow more restarts",
        )
    mine = [d for d in deaths if d.node == last.node]
    recent = [d for d in mine if last.time_s - d.time_s <= policy.crash_loop_window_s]
    budget = f"death {len(deaths)} of backoffLimit {policy.backoff_limit}"
    if len(recent) >= policy.crash_loop_deaths:
        return Verdict(
            "replace",
            f"{what}; crash loop: {len(recent)} deaths within {policy.crash_loop_window_s:.0f}s, "
            f"the node is excluded and replaced ({budget})",
        )
    delay = backoff(policy, len(mine))
    going_on = "the others go on" if live >= policy.min_nodes else f"the others wait for minReplicas {policy.min_nodes}"
    return Verdict("restart", f"{what}; restarting it in {delay:g}s, {going_on} ({budget})", delay)
