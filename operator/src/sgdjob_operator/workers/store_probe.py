"""Ask a job's rendezvous store whether it serves, and tell it the job's intended size.

Shared by both shells: the operator asks the store's pod every pass, the local runner its store
process. The endpoint is the store's own (`python -m sgdjob_trainer.rendezvous_store --health-port`).
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from sgdjob_trainer.wire.launch_contract import STORE_HEALTH_PATH

# A pod on a live node accepts within milliseconds; a powered-off or cut-off one never answers.
POD_PROBE_TIMEOUT_S = 2.0


async def store_answers(
    session: aiohttp.ClientSession,
    ip: str,
    port: int,
    timeout_s: float = POD_PROBE_TIMEOUT_S,
    nodes: int | None = None,
    departed: Sequence[str] = (),
) -> bool:
    """Whether the store at `ip` answers its health check (STORE_HEALTH_PATH: 200 after a round
    trip through the store itself) within `timeout_s`. Not a TCP connect: a hung store (stopped, its
    server thread deadlocked) still accepts connections, the kernel completing them into its backlog.
    Refused, timed out, or any other status (503: the store's own round trip failed) is silence.
    With `nodes`, the check is a PUT that also tells the store the job's intended size (the agents'
    rounds complete when that many joined) and `departed`, agents removed on purpose (their peers
    drop them from the rendezvous at once); a store too old for PUT (501) is asked with GET."""
    host = f"[{ip}]" if ":" in ip else ip
    url = f"http://{host}:{port}{STORE_HEALTH_PATH}"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if nodes is not None:
            params = {"nodes": str(nodes), **({"departed": ",".join(departed)} if departed else {})}
            async with session.put(url, params=params, timeout=timeout, allow_redirects=False) as resp:
                if resp.status != 501:
                    return resp.status == 200
        async with session.get(url, timeout=timeout, allow_redirects=False) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False
