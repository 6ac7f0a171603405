"""The operator's own Prometheus metrics (served when --metrics-port is given)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from sgdjob_operator.api.models import Phase

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE_SECONDS = Histogram(
    "sgdjob_operator_reconcile_seconds",
    "Seconds one reconciliation of one SGDJob took (read, plan, write).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "sgdjob_operator_reconcile_errors", "Reconciliations that failed and will be retried.", registry=REGISTRY
)
DECISIONS = Counter(
    "sgdjob_operator_decisions",
    "Policy decisions applied, by action and reason.",
    ["action", "reason"],
    registry=REGISTRY,
)
DEFERRED = Counter(
    "sgdjob_operator_decisions_deferred",
    "Policy decisions not applied because another change was in flight.",
    ["action"],
    registry=REGISTRY,
)
JOBS = Gauge("sgdjob_operator_jobs", "SGDJobs by phase.", ["phase"], registry=REGISTRY)
SCRAPE_ERRORS = Counter(
    "sgdjob_operator_scrape_errors", "Worker /metrics scrapes that failed or timed out.", registry=REGISTRY
)
CONTROL_PUSHES = Counter(
    "sgdjob_operator_control_pushes", "POST /control attempts, by result.", ["result"], registry=REGISTRY
)
PODS_CREATED = Counter("sgdjob_operator_pods_created", "Pods the operator created.", ["role"], registry=REGISTRY)
LEADER = Gauge(
    "sgdjob_operator_leader",
    "1 while this replica acts on SGDJobs (the leader, or the only replica); 0 while it stands by.",
    registry=REGISTRY,
)
PODS_DELETED = Counter("sgdjob_operator_pods_deleted", "Pods the operator deleted, by why.", ["why"], registry=REGISTRY)


def reason_label(reason: str) -> str:
    """A bounded label value: the reason's first words, never a number-laden sentence."""
    words = [w for w in reason.replace(":", " ").split() if w.isalpha()][:4]
    return " ".join(words)[:64] or "unspecified"


def set_phases(phases: Iterable[str]) -> None:
    counts = {p.value: 0 for p in Phase}
    for phase in phases:
        counts[phase] = counts.get(phase, 0) + 1
    for phase, count in counts.items():
        JOBS.labels(phase=phase).set(count)


class _Served:
    port: int | None = None


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Once per process: a standby starts it, and the same server goes on when it becomes leader."""
    if _Served.port == port:
        return
    start_http_server(port, addr=host, registry=REGISTRY)
    _Served.port = port
