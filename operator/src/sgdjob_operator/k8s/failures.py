"""Which worker failures spend `runPolicy.backoffLimit` (pure), in the spirit of a Kubernetes Job's
pod failure policy with fixed rules: the infrastructure's faults are retried for free, the user's code
crashing is counted. The first rule that matches decides, and its text is the root cause the job's
Event (and, past the limit, its message) names; a traceback's tail stays in the pod's log.

1. The pod's reason is the kubelet's or a controller's (evicted, preempted, node shutdown, ...).
2. The pod was deleted while it ran (`kubectl delete`, a drain): torchrun exits non-zero on SIGTERM.
3. Its node is not Ready: the kubelet that reported the failure lost its node, or is losing it.
4. The agent exited `EXIT_RENDEZVOUS_CLOSED`: the job's world ended before it got one.
4a. The agent exited `EXIT_RENDEZVOUS_TIMEOUT`: fewer than minReplicas workers joined its rendezvous
   within the join timeout, so no world formed. Its peers vanished (a lost node's pods force-deleted,
   the node gone or back, which rule 6 no longer sees) or were not scheduled yet. This hides no crash
   loop: a peer whose code crashes fails its own pod with its own exit status, which counts, and our
   agent exits 1, not this status, for a user's program that exits with it. (Rules 4 and 4a need
   `sgdjob_trainer.agent` in the pod, as the trainer's worker pods and command mode's pods on an image
   that holds it run it: a plain `torchrun`, which command mode falls back to on an image without it,
   exits 1 for both, and that counts. Worker pods wait a day for their
   peers (builders.K8S_JOIN_TIMEOUT_S), so their rendezvous does not time out, and close, while
   the operator brings the peers back.)
4b. The store did not answer the operator when the worker failed, or was re-homed after the worker's
   pod was created (storeloss.py): the agent lost the store it had joined.
5. The rendezvous store moved (its pod is gone or being replaced) or sits on a node not Ready:
   torchrun fails its rendezvous, however healthy the worker. A store pod that never starts (a bad
   image) is no such case: the job's crash loop then counts, or it would never end.
6. A peer's node is not Ready: the collective or the rendezvous timed out because the peer vanished.
7. Anything else (a non-zero exit, OOMKilled) is the job's own failure and counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sgdjob_operator.k8s.status import INFRA_REASONS, PodView, rdzv_pods, rfc3339, workers
from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_CLOSED, EXIT_RENDEZVOUS_TIMEOUT


@dataclass(frozen=True, slots=True)
class Verdict:
    counted: bool  # spends backoffLimit
    cause: str  # the root cause, for the Event and the job's message


def _node_state(lost: Mapping[str, tuple[float, str]], node: str) -> str:
    since, how = lost[node]
    return f"{how} since {rfc3339(since)}"


def classify(
    pod: PodView, pods: Sequence[PodView], lost: Mapping[str, tuple[float, str]], store_cause: str | None = None
) -> Verdict:
    """Why the failed worker `pod` failed, and whether it counts (see the module docstring).
    `pods`: all the job's pods; `lost`: the not-Ready nodes among theirs (`nodeloss.not_ready_since`);
    `store_cause`: the store's part in it, if any (`storeloss.store_failure_cause`)."""
    exit_code = f"exit code {pod.exit_code}" if pod.exit_code is not None else "no exit code"
    if pod.reason in INFRA_REASONS:
        return Verdict(False, f"worker pod {pod.name} {pod.reason} by the cluster ({exit_code})")
    if pod.deleting:
        return Verdict(False, f"worker pod {pod.name} deleted while it ran ({exit_code})")
    if pod.node is not None and pod.node in lost:
        return Verdict(False, f"worker pod {pod.name} lost with node {pod.node} ({_node_state(lost, pod.node)})")
    if pod.exit_code == EXIT_RENDEZVOUS_CLOSED:
        return Verdict(False, f"worker pod {pod.name} found the job's rendezvous closed (exit code {pod.exit_code})")
    if pod.exit_code == EXIT_RENDEZVOUS_TIMEOUT:
        return Verdict(
            False,
            f"worker pod {pod.name} could not form a world: fewer than minReplicas workers joined its "
            f"rendezvous in time (exit code {pod.exit_code})",
        )
    if store_cause:
        return Verdict(False, f"worker pod {pod.name} failed ({exit_code}): {store_cause}")
    stores = [s for s in rdzv_pods(pods) if not s.deleting]
    moved = next((s for s in stores if s.node is not None and s.node in lost), None)
    if moved is not None and moved.node is not None:
        where = f"on node {moved.node} ({_node_state(lost, moved.node)})"
        return Verdict(False, f"worker pod {pod.name} failed ({exit_code}): rendezvous store {where}")
    if not stores:
        return Verdict(False, f"worker pod {pod.name} failed ({exit_code}): rendezvous store being replaced")
    gone = next((p for p in workers(pods) if p.name != pod.name and p.node in lost and p.node), None)
    if gone is not None and gone.node is not None:
        return Verdict(
            False,
            f"worker pod {pod.name} failed ({exit_code}) after its peer {gone.name} was lost with node "
            f"{gone.node} ({_node_state(lost, gone.node)})",
        )
    return Verdict(True, f"worker pod {pod.name} failed ({exit_code}, {pod.reason or 'Error'}); see its log")
