"""What a pass tells the world: the job's status, written only when it changed, and its Events (a
condition that repeats every pass as one Event per distinct message, not one per pass)."""

from __future__ import annotations

import logging
from typing import Any

from sgdjob_operator.api.models import SGDJobStatus
from sgdjob_operator.k8s.builders import JobRef
from sgdjob_operator.k8s.client import ApiError
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.status import Event, dump_status

log = logging.getLogger("sgdjob_operator")


async def post_events(rt: Runtime, ref: JobRef, events: list[Event]) -> None:
    for ev in events:
        try:
            await rt.kube.post_event(ref, ev.type, ev.reason, ev.message)
        except ApiError as err:  # an Event is worth a log line, never a failed pass
            log.warning("cannot post event %s for %s/%s: %s", ev.reason, ref.namespace, ref.name, err)
        (log.warning if ev.type == "Warning" else log.info)(
            "%s/%s %s: %s", ref.namespace, ref.name, ev.reason, ev.message
        )


async def event_once(rt: Runtime, ref: JobRef, kind: str, message: str, ev_type: str = "Warning") -> list[Event]:
    """An Event for a condition that repeats every pass (a worker that cannot be scraped): posted when
    the condition's text changes, not every time."""
    key = (ref.uid, kind)
    if rt.noisy.get(key) == message:
        return []
    rt.noisy[key] = message
    return [Event(ev_type, kind, message)] if message else []


def pruned(value: Any) -> Any:
    """JSON as the API server stores it after a merge patch: no null members."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


async def write_status(rt: Runtime, ref: JobRef, before: dict[str, Any], st: SGDJobStatus, events: list[Event]) -> None:
    """Write status only when it changed (each write wakes every watcher), then post the Events:
    a decision is in status before anyone hears of it."""
    after = dump_status(st)
    if pruned(after) != pruned(before):
        await rt.kube.patch_job_status(ref, after)
    await post_events(rt, ref, events)
