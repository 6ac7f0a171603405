"""What a pass asks beyond the API's objects: which of the job's nodes are not Ready (or Ready again),
whether the store answers its health check, and which pods on lost nodes still answer. The pure
decisions on the answers are in `nodeloss`, `storeloss` and `plan`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import aiohttp

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.k8s.builders import RDZV_HEALTH_PORT
from sgdjob_operator.k8s.nodeloss import not_ready_since
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.status import PodView
from sgdjob_operator.k8s.status import workers as worker_pods
from sgdjob_operator.k8s.storeloss import store_to_probe
from sgdjob_trainer.wire.launch_contract import STORE_HEALTH_PATH

# A pod on a live node accepts within milliseconds; a powered-off or cut-off one never answers.
POD_PROBE_TIMEOUT_S = 2.0


async def _accepts(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), POD_PROBE_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def store_answers(
    session: aiohttp.ClientSession, ip: str, port: int = RDZV_HEALTH_PORT, timeout_s: float = POD_PROBE_TIMEOUT_S
) -> bool:
    """Whether the store at `ip` answers its health check (GET STORE_HEALTH_PATH: 200 after a round
    trip through the store itself) within `timeout_s`. Not a TCP connect: a hung store (stopped, its
    server thread deadlocked) still accepts connections, the kernel completing them into its backlog.
    Refused, timed out, or any other status (503: the store's own round trip failed) is silence."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with session.get(
            f"http://{host}:{port}{STORE_HEALTH_PATH}",
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def probe_store(rt: Runtime, pods: list[PodView]) -> bool | None:
    """Whether the store's pod answers its health check (`store_answers`; None: no running store, or
    an operator that reaches pods through SGDJOB_SCRAPE_HOST, which cannot address the store)."""
    store = store_to_probe(pods)
    if store is None or store.ip is None or rt.settings.scrape_host:
        return None
    return await store_answers(rt.http, store.ip)


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
