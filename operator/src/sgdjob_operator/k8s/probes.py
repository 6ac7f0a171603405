"""What a pass asks beyond the API's objects: which of the job's nodes are not Ready (or Ready again),
whether the store answers its health check, and which pods on lost nodes still answer. The pure
decisions on the answers are in `nodeloss`, `storeloss` and `plan`."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.k8s.builders import RDZV_HEALTH_PORT
from sgdjob_operator.k8s.nodeloss import not_ready_since
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.status import PodView
from sgdjob_operator.k8s.status import workers as worker_pods
from sgdjob_operator.k8s.storeloss import store_to_probe
from sgdjob_operator.workers.store_probe import POD_PROBE_TIMEOUT_S, store_answers


async def _accepts(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), POD_PROBE_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def probe_store(
    rt: Runtime, pods: list[PodView], nodes: int | None = None, departed: Sequence[str] = ()
) -> bool | None:
    """Whether the store's pod answers its health check (`store_answers`, telling it `nodes`, the
    worker pods the job wants, and `departed`, agents removed on purpose; None: no running store, or
    an operator that reaches pods through SGDJOB_SCRAPE_HOST, which cannot address the store)."""
    store = store_to_probe(pods)
    if store is None or store.ip is None or rt.settings.scrape_host:
        return None
    return await store_answers(rt.http, store.ip, RDZV_HEALTH_PORT, nodes=nodes, departed=departed)


def departing_agents(pods: Sequence[PodView], deleting: Collection[str], lost: Collection[str]) -> list[str]:
    """The agents (pod UIDs) a pass removes on purpose: running worker pods it deletes on nodes that
    answer. Their peers take them off the rendezvous at once (sgdjob_trainer.rendezvous_rounds); a lost
    node's pod is left to its heartbeats, as its node may come back with the pod still running."""
    return [
        p.uid
        for p in worker_pods(pods)
        if p.name in deleting and p.uid and p.phase == "Running" and not p.deleting and p.node not in lost
    ]


async def answering_on_lost_nodes(
    rt: Runtime, spec: SGDJobSpec, pods: list[PodView], lost: Mapping[str, object], store_answered: bool | None
) -> frozenset[str]:
    """The pods on lost nodes that still answer: a worker that takes a connection at its (first)
    metrics port, the store as `probe_store` found it (its health check). An operator that reaches
    pods through SGDJOB_SCRAPE_HOST cannot address one pod: none then."""
    if not lost or rt.settings.scrape_host:
        return frozenset()
    store = store_to_probe(pods)
    found = {store.name} if store is not None and store.node in lost and store_answered else set()
    on_lost = [p for p in worker_pods(pods) if p.node in lost and p.ip and p.phase == "Running"]
    accepted = await asyncio.gather(*(_accepts(p.ip or "", spec.training.metrics_port) for p in on_lost))
    found |= {p.name for p, ok in zip(on_lost, accepted, strict=True) if ok}
    return frozenset(found)


async def lost_nodes(rt: Runtime, pods: list[PodView]) -> dict[str, tuple[float, str]]:
    """The not-Ready nodes among those the job's pods are bound to (a cached GET per node: the
    watch cache's Node objects are as fresh as the node controller's writes)."""
    names = sorted({p.node for p in pods if p.node and p.phase not in ("Succeeded", "Failed")})
    found = await asyncio.gather(*(rt.kube.get_node(n) for n in names))
    out: dict[str, tuple[float, str]] = {}
    for name, node in zip(names, found, strict=True):
        state = not_ready_since(node)
        if state is not None:
            out[name] = state
    return out


async def ready_again(rt: Runtime, names: Sequence[str]) -> frozenset[str]:
    """Which of `names` (nodes excluded as lost) exist and are Ready now."""
    found = await asyncio.gather(*(rt.kube.get_node(n) for n in names))
    return frozenset(n for n, node in zip(names, found, strict=True) if node is not None and not not_ready_since(node))
