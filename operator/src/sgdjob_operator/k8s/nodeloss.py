"""Pods on a lost node (pure): a node whose kubelet stopped reporting keeps its pods' objects as they
were (Running, or Terminating for good) until the node lifecycle controller evicts them after the 300 s
`unreachable` toleration. The job does not wait that long: after `runPolicy.nodeLostGraceSeconds` its
pods there are force-deleted (grace 0: no kubelet will confirm a graceful stop) and recreated on the
other nodes, the node excluded like a slow one's.

A pod's name is its index (`<job>-worker-<i>`), so the API server never holds two pods of one index;
a partitioned node's containers that still run are cut off from the new world by the rendezvous (the
store's run id moves on) and die with their node's kubelet when it comes back and finds no pod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sgdjob_operator.k8s.status import PodView, parse_time

NEVER_SEEN = 0.0  # a Ready condition without a time: lost since long ago


@dataclass(frozen=True, slots=True)
class LostPod:
    pod: str
    node: str
    since: float  # when the node's Ready condition left True
    how: str  # the node's condition, for the Event and the job's message


def not_ready_since(node: Mapping[str, Any] | None) -> tuple[float, str] | None:
    """(since when, how) the node has not been Ready, or None while it is. A Node object that does
    not exist (None) is left to Kubernetes' pod garbage collector, which deletes the pods of a deleted
    node at once; a Ready condition without a time counts from `NEVER_SEEN`."""
    if node is None:
        return None
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") != "Ready":
            continue
        if cond.get("status") == "True":
            return None
        since = parse_time(cond.get("lastTransitionTime")) or NEVER_SEEN
        state = "NotReady" if cond.get("status") == "False" else "Unknown"
        why = cond.get("reason") or ""
        return since, f"Ready={state}{' (' + why + ')' if why else ''}"
    return None  # no Ready condition yet: a node still registering, not a lost one


def lost_pods(
    pods: Sequence[PodView], nodes: Mapping[str, tuple[float, str]], *, now: float, grace_s: float
) -> list[LostPod]:
    """The job's pods (workers and the rendezvous store) on a node not Ready for `grace_s` or more.
    `nodes`: the not-Ready nodes among the pods' (`not_ready_since`). A pod that finished is left
    alone: it holds no rank, and a succeeded worker's exit is how the job learns it is done."""
    out = []
    for pod in pods:
        state = nodes.get(pod.node or "")
        if state is None or pod.phase in ("Succeeded", "Failed"):
            continue
        since, how = state
        if now - since >= grace_s:
            out.append(LostPod(pod.name, pod.node or "", since, how))
    return out
