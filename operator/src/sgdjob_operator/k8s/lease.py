"""Leader election's pure core: what a coordination.k8s.io/v1 Lease says, whether this replica may
take it, and the Lease objects to write. The shell (k8s/election.py) only reads and writes them.

Safety rests on one rule, the same as client-go's leaderelection: a standby measures a holder's
lease from the moment *it saw* the record change (its own monotonic clock, so no clock skew between
nodes matters), and takes over only after a whole `leaseDurationSeconds` of no change; the leader
stops acting once `renewDeadline` has passed since it last *sent* a renewal that succeeded. With
renewDeadline < leaseDuration the old leader has stopped before any standby may start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

API_VERSION = "coordination.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds, as client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def problem(self) -> str | None:
        """Why these timings cannot guarantee one leader, naming the flags; None when they can."""
        if min(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s) <= 0:
            return "--lease-duration, --renew-deadline and --retry-period must be positive"
        if self.renew_deadline_s >= self.lease_duration_s:
            return (
                f"--renew-deadline ({self.renew_deadline_s:g}s) must be shorter than --lease-duration "
                f"({self.lease_duration_s:g}s), or a standby could start before the old leader stops"
            )
        if self.retry_period_s * 2 > self.renew_deadline_s:
            return (
                f"--retry-period ({self.retry_period_s:g}s) must be at most half of --renew-deadline "
                f"({self.renew_deadline_s:g}s), so one failed renewal does not cost the lease"
            )
        return None

    def failover_s(self) -> float:
        """Worst case from a leader's death to a standby holding the lease: the standby may have seen
        the last renewal up to one retry late, and notices expiry up to one retry late."""
        return self.lease_duration_s + 2 * self.retry_period_s


@dataclass(frozen=True, slots=True)
class Seen:
    """The record as a standby last saw it, and when (its monotonic clock) it last changed."""

    holder: str
    record: tuple[Any, ...]
    duration_s: float
    changed_at: float


def _spec(lease: dict[str, Any] | None) -> dict[str, Any]:
    return dict((lease or {}).get("spec") or {})


def holder(lease: dict[str, Any] | None) -> str:
    return str(_spec(lease).get("holderIdentity") or "")


def observe(prev: Seen | None, lease: dict[str, Any] | None, now: float, default_duration_s: float) -> Seen:
    """Fold one read of the Lease into what was seen: the change time moves only when the holder
    or its renewTime changed (a renewal), never because time passed."""
    spec = _spec(lease)
    record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
    duration = float(spec.get("leaseDurationSeconds") or default_duration_s)
    if prev is not None and prev.record == record:
        return Seen(prev.holder, record, duration, prev.changed_at)
    return Seen(holder(lease), record, duration, now)


def may_acquire(seen: Seen, me: str, now: float) -> bool:
    """Free (no holder, or released), already ours, or unrenewed for a whole lease duration."""
    return not seen.holder or seen.holder == me or now - seen.changed_at >= seen.duration_s


def micro_time(wall: float) -> str:
    """RFC 3339 with microseconds, the MicroTime format Leases carry."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1e6):06d}Z"


def acquired(
    lease: dict[str, Any] | None, *, name: str, namespace: str, me: str, duration_s: float, wall: float
) -> dict[str, Any]:
    """The Lease that makes `me` the holder: a new object, or the read one with its resourceVersion
    kept so the write fails (409) if anyone else wrote in between."""
    spec = _spec(lease)
    stamp = micro_time(wall)
    taking_over = spec.get("holderIdentity") != me
    new_spec = {
        **spec,
        "holderIdentity": me,
        "leaseDurationSeconds": max(1, round(duration_s)),
        "renewTime": stamp,
    }
    if taking_over:
        new_spec["acquireTime"] = stamp
        new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease else 0)
    meta = dict((lease or {}).get("metadata") or {"name": name, "namespace": namespace})
    return {"apiVersion": API_VERSION, "kind": "Lease", "metadata": meta, "spec": new_spec}


def renewed(lease: dict[str, Any], wall: float) -> dict[str, Any]:
    return {**lease, "spec": {**_spec(lease), "renewTime": micro_time(wall)}}


def released(lease: dict[str, Any], wall: float) -> dict[str, Any]:
    """Handed back on a clean shutdown: no holder, so a standby takes it on its next try instead of
    waiting out the lease."""
    spec = {**_spec(lease), "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time(wall)}
    return {**lease, "spec": spec}
