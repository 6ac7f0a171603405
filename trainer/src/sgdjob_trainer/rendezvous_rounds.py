"""The agent's c10d rendezvous, changed so that a membership change does not wait torch's last call.

torch's c10d rendezvous completes a round at max nodes, or `last_call_timeout` after min nodes are
in; and a round that completed moves on only when every participant has left it, which a stopped
agent never does itself (torchrun keeps the rendezvous open on a signal), so its peers wait for its
heartbeats to lapse (keep_alive_interval x keep_alive_max_attempt). After the operator removes a
worker that is both: on the real-node cluster 10 s + 10 s of a 24-s restart (#37).

- **A round completes at the job's intended size.** The job's controller writes how many nodes it
  wants now under `INTENDED_NODES_KEY` in the rendezvous store (the operator through the store pod's
  health endpoint, every pass); a participant completes the round as soon as that many have joined
  (within min..max), without the last call. No key, or fewer joined: torch's rules, unchanged.
- Not done: an agent stopped by a signal still leaves its peers to wait for its heartbeats to lapse.
  Taking it off the rendezvous at once (tried in b8c6ecc) made a suspend lose its final checkpoint in
  one clean CI run of two (chaos cases d and h), so it was taken out until that is understood.

The backend is torch's c10d one (same store, keys and state), registered again under
`SIZED_BACKEND` so only this agent's handlers behave so; agents of either kind share a rendezvous.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sgdjob_trainer.wire.launch_contract import INTENDED_NODES_KEY, RDZV_BACKEND

log = logging.getLogger("sgdjob_trainer.rendezvous_rounds")

SIZED_BACKEND = "sgdjob-c10d"


def intended_nodes(store: Any) -> int | None:
    """The node count the job's controller wants now, from the store (None: not said, or unreadable)."""
    try:
        if not store.check([INTENDED_NODES_KEY]):
            return None
        return int(store.get(INTENDED_NODES_KEY))
    except Exception:  # a store that fails here fails the rendezvous' own next call, which says why
        return None


def complete_at(state: Any, node: Any, settings: Any, intended: int | None) -> bool:
    """Whether `node` completes the open round now: it takes part, and the intended size has joined."""
    if intended is None or state.closed or state.complete or node not in state.participants:
        return False
    if node in state.redundancy_list:
        return False
    joined = len(state.participants)
    return bool(settings.min_nodes <= intended <= joined <= settings.max_nodes)


class _SizedJoin:
    """torch's join operation, which also completes a round at the intended size."""

    def __init__(self, inner: Callable[[Any, float], Any], intended: Callable[[], int | None]) -> None:
        self._inner = inner
        self._intended = intended

    def __call__(self, ctx: Any, deadline: float) -> Any:
        if time.monotonic() <= deadline and complete_at(ctx.state, ctx.node, ctx.settings, self._intended()):
            log.info(
                "rendezvous: %d nodes joined, the job's intended size: round complete", len(ctx.state.participants)
            )
            return dyn._Action.MARK_RENDEZVOUS_COMPLETE
        return self._inner(ctx, deadline)


def sized(handler: dyn.DynamicRendezvousHandler) -> dyn.DynamicRendezvousHandler:
    """`handler`, its join operations made `_SizedJoin`s (the intended size read from its store)."""
    executor = handler._op_executor
    run = executor.run
    store = handler._store

    def run_sized(state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
        if isinstance(state_handler, dyn._RendezvousJoinOp):
            state_handler = _SizedJoin(state_handler, lambda: intended_nodes(store))
        run(state_handler, deadline, update_deadline)

    executor.run = run_sized  # type: ignore[method-assign]
    return handler


def _create(params: RendezvousParameters) -> RendezvousHandler:
    params = copy.copy(params)
    params.backend = RDZV_BACKEND  # torch's c10d backend builds it; the name is only the registry's
    handler = get_rendezvous_handler(params)
    if not isinstance(handler, dyn.DynamicRendezvousHandler):  # torch changed how c10d is built
        log.warning("rendezvous: %s is not torch's dynamic handler: rounds end by torch's rules", type(handler))
        return handler
    handler._backend_name = SIZED_BACKEND  # the registry checks the name it was asked for
    if not _torch_has_what_we_use(handler):
        log.warning("rendezvous: this torch's c10d handler lacks what rendezvous_rounds uses: torch's rules")
        return handler
    return sized(handler)


def _torch_has_what_we_use(handler: dyn.DynamicRendezvousHandler) -> bool:
    """The private parts of torch's handler this module relies on (torch 2.4-2.13 have them all)."""
    actions = ("MARK_RENDEZVOUS_COMPLETE",)
    return (
        hasattr(dyn, "_RendezvousJoinOp")
        and all(hasattr(getattr(dyn, "_Action", None), a) for a in actions)
        and hasattr(getattr(handler, "_op_executor", None), "run")
        and hasattr(handler, "_store")
    )


def register() -> str:
    """Register `SIZED_BACKEND` (once per process); returns its name for the launch config."""
    if not rendezvous_handler_registry._registry.get(SIZED_BACKEND):
        rendezvous_handler_registry.register(SIZED_BACKEND, _create)
    return SIZED_BACKEND
