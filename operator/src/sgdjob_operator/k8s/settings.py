"""The operator's settings: one frozen value, filled from the command line or the environment, and
applied to kopf in one startup handler. Environment names are what a Helm chart sets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sgdjob_operator.k8s.builders import DEFAULT_IMAGE


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    return float(value) if value else default


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    trainer_image: str = DEFAULT_IMAGE
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    kubeconfig: str | None = None
    context: str | None = None
    # Seconds between two reconciliations of a job when nothing wakes it (pod or job events do).
    resync_s: float = 30.0
    # Least seconds between two reconciliations of one job, so a burst of pod events is one pass.
    min_tick_s: float = 0.2
    scrape_timeout_s: float = 2.0
    # A Running, ready worker that has not answered a scrape for this long is a Warning Event; before
    # that it is taken for a trainer still starting (imports, rendezvous) or one that is finishing.
    scrape_grace_s: float = 120.0
    # Scrape a pod at this host instead of its podIP (tests, port-forwarding); empty: podIP.
    scrape_host: str = ""
    scrape_scheme: str = "http"
    metrics_port: int = 0  # operator's own Prometheus endpoint; 0: off
    metrics_host: str = "0.0.0.0"
    liveness: str | None = None
    # Requests in flight to the API server at once (aiohttp connection limit), across all jobs.
    api_concurrency: int = 32
    # Validating admission webhook (kopf's server): off unless a port is given; TLS from these files.
    webhook_port: int = 0
    webhook_addr: str = "0.0.0.0"
    webhook_cert: str | None = None
    webhook_key: str | None = None
    # Folder of the mounted service account (token, ca.crt) for in-cluster credentials.
    service_account_dir: str | None = None
    # Leader election over a Lease (k8s/election.py): only the holder runs kopf; off for one replica.
    leader_election: bool = False
    lease_name: str = "sgdjob-operator"
    lease_namespace: str | None = None  # default: $POD_NAMESPACE, else "default"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if env is None else env
        namespaces = tuple(ns for ns in env.get("SGDJOB_NAMESPACES", "").split(",") if ns)
        return cls(
            trainer_image=env.get("SGDJOB_TRAINER_IMAGE") or DEFAULT_IMAGE,
            namespaces=namespaces,
            kubeconfig=env.get("SGDJOB_KUBECONFIG") or None,
            resync_s=_float(env, "SGDJOB_RESYNC_SECONDS", 30.0),
            scrape_timeout_s=_float(env, "SGDJOB_SCRAPE_TIMEOUT_SECONDS", 2.0),
            scrape_grace_s=_float(env, "SGDJOB_SCRAPE_GRACE_SECONDS", 120.0),
            scrape_host=env.get("SGDJOB_SCRAPE_HOST", ""),
            metrics_port=int(env.get("SGDJOB_OPERATOR_METRICS_PORT") or 0),
            metrics_host=env.get("SGDJOB_OPERATOR_METRICS_HOST") or "0.0.0.0",
            liveness=env.get("SGDJOB_LIVENESS") or None,
            api_concurrency=int(env.get("SGDJOB_API_CONCURRENCY") or 32),
            webhook_port=int(env.get("SGDJOB_WEBHOOK_PORT") or 0),
            webhook_addr=env.get("SGDJOB_WEBHOOK_ADDR") or "0.0.0.0",
            webhook_cert=env.get("SGDJOB_WEBHOOK_CERT") or None,
            webhook_key=env.get("SGDJOB_WEBHOOK_KEY") or None,
            service_account_dir=env.get("SGDJOB_SERVICE_ACCOUNT_DIR") or None,
            leader_election=env.get("SGDJOB_LEADER_ELECTION", "").lower() in ("1", "true", "yes"),
            lease_name=env.get("SGDJOB_LEASE_NAME") or "sgdjob-operator",
            lease_namespace=env.get("SGDJOB_LEASE_NAMESPACE") or None,
            lease_duration_s=_float(env, "SGDJOB_LEASE_DURATION_SECONDS", 15.0),
            renew_deadline_s=_float(env, "SGDJOB_RENEW_DEADLINE_SECONDS", 10.0),
            retry_period_s=_float(env, "SGDJOB_RETRY_PERIOD_SECONDS", 2.0),
        )

    def with_(self, **changes: object) -> OperatorSettings:
        return replace(self, **changes)  # type: ignore[arg-type]


class _Holder:
    """The settings the running operator uses: the CLI sets them before kopf starts; `kopf run -m
    sgdjob_operator` leaves them to the environment."""

    value: OperatorSettings | None = None


def current() -> OperatorSettings:
    if _Holder.value is None:
        _Holder.value = OperatorSettings.from_env()
    return _Holder.value


def set_current(settings: OperatorSettings) -> None:
    _Holder.value = settings
