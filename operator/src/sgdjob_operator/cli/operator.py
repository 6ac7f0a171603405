"""`sgdjob operator`: run the kopf operator in this process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import click


@click.command("operator")
@click.option(
    "--namespace", "-n", "namespaces", multiple=True, help="Watch this namespace (repeatable). Default: all namespaces."
)
@click.option(
    "--all-namespaces", "-A", is_flag=True, help="Watch every namespace (the default when no --namespace is given)."
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    default=None,
    help="Kubeconfig file; default: in-cluster service account, else $KUBECONFIG or ~/.kube/config.",
)
@click.option("--context", default=None, help="Kubeconfig context.")
@click.option(
    "--liveness", default=None, metavar="URL", help="Serve a liveness probe, e.g. http://0.0.0.0:8080/healthz."
)
@click.option(
    "--metrics-port", type=int, default=None, help="Serve the operator's Prometheus metrics on this port (0: off)."
)
@click.option("--metrics-host", default=None, help="Address for the metrics server (default 0.0.0.0).")
@click.option(
    "--trainer-image", default=None, help="Image for worker pods whose template names none (env SGDJOB_TRAINER_IMAGE)."
)
@click.option(
    "--scrape-host", default=None, help="Scrape workers at this host instead of their pod IPs (tests, port-forwarding)."
)
@click.option("--resync", type=float, default=None, help="Seconds between passes over a quiet job (default 30).")
@click.option(
    "--webhook-port",
    type=int,
    default=None,
    help="Serve the validating admission webhook (path /validate) on this port over TLS.",
)
@click.option("--webhook-addr", default=None, help="Address for the webhook server (default 0.0.0.0).")
@click.option(
    "--webhook-cert", type=click.Path(dir_okay=False), default=None, help="PEM certificate (chain) the webhook serves."
)
@click.option("--webhook-key", type=click.Path(dir_okay=False), default=None, help="PEM private key of --webhook-cert.")
@click.option(
    "--service-account-dir",
    type=click.Path(file_okay=False),
    default=None,
    help=(
        "In-cluster credentials from this folder (token, ca.crt) "
        "instead of /var/run/secrets/kubernetes.io/serviceaccount."
    ),
)
@click.option(
    "--leader-elect/--no-leader-elect",
    default=None,
    help="Run as one of several replicas: act only while holding a coordination.k8s.io Lease "
    "(env SGDJOB_LEADER_ELECTION). Default: off.",
)
@click.option("--lease-name", default=None, help="Name of the Lease (default sgdjob-operator).")
@click.option("--lease-namespace", default=None, help="Namespace of the Lease (default $POD_NAMESPACE, else default).")
@click.option("--lease-duration", type=float, default=None, help="Seconds a standby waits out an unrenewed lease (15).")
@click.option(
    "--renew-deadline", type=float, default=None, help="Seconds without renewal after which a leader exits (10)."
)
@click.option("--retry-period", type=float, default=None, help="Seconds between lease renewals and tries (2).")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging.")
def operator(
    namespaces: tuple[str, ...],
    all_namespaces: bool,
    kubeconfig: str | None,
    context: str | None,
    liveness: str | None,
    metrics_port: int | None,
    metrics_host: str | None,
    trainer_image: str | None,
    scrape_host: str | None,
    resync: float | None,
    webhook_port: int | None,
    webhook_addr: str | None,
    webhook_cert: str | None,
    webhook_key: str | None,
    service_account_dir: str | None,
    leader_elect: bool | None,
    lease_name: str | None,
    lease_namespace: str | None,
    lease_duration: float | None,
    renew_deadline: float | None,
    retry_period: float | None,
    verbose: bool,
) -> None:
    """Run the SGDJob operator (kopf) until interrupted."""
    if namespaces and all_namespaces:
        raise click.UsageError("give --namespace or --all-namespaces, not both")
    # The Kubernetes shell is imported when this command runs: importing the CLI never loads it.
    from sgdjob_operator.k8s.settings import OperatorSettings, set_current

    base = OperatorSettings.from_env()
    changes: dict[str, object] = {"namespaces": namespaces, "context": context}
    for name, value in (
        ("kubeconfig", kubeconfig),
        ("liveness", liveness),
        ("metrics_port", metrics_port),
        ("metrics_host", metrics_host),
        ("trainer_image", trainer_image),
        ("scrape_host", scrape_host),
        ("resync_s", resync),
        ("webhook_port", webhook_port),
        ("webhook_addr", webhook_addr),
        ("webhook_cert", webhook_cert),
        ("webhook_key", webhook_key),
        ("service_account_dir", service_account_dir),
        ("leader_election", leader_elect),
        ("lease_name", lease_name),
        ("lease_namespace", lease_namespace),
        ("lease_duration_s", lease_duration),
        ("renew_deadline_s", renew_deadline),
        ("retry_period_s", retry_period),
    ):
        if value is not None:
            changes[name] = value
    settings = base.with_(**changes)
    from sgdjob_operator.k8s.lease import Timings
    from sgdjob_operator.k8s.webhook import check

    timings = Timings(settings.lease_duration_s, settings.renew_deadline_s, settings.retry_period_s)
    problem = check(settings) or (timings.problem() if settings.leader_election else None)
    if problem:
        raise click.UsageError(problem)
    set_current(settings)
    if settings.service_account_dir:
        use_service_account_dir(settings.service_account_dir)
    if settings.kubeconfig:
        os.environ["KUBECONFIG"] = settings.kubeconfig  # for anything that reads the default location
    import kopf

    import sgdjob_operator.k8s.handlers  # noqa: F401 - registers the handlers
    from sgdjob_operator.k8s import webhook

    kopf.configure(verbose=verbose, debug=False, log_prefix=True)
    if not verbose:
        # kopf logs every handled pod event at INFO; with hundreds of workers that is noise and CPU.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    unresolved = UnresolvedWatch()
    logging.getLogger("kopf").addHandler(unresolved)

    def run_kopf() -> Coroutine[Any, Any, None]:
        unresolved.armed = True
        return kopf.operator(
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            liveness_endpoint=settings.liveness,
        )

    async def serve() -> None:
        # The webhook outlives kopf: it answers while a standby waits, while kopf starts and stops.
        async with webhook.serving(settings):
            if settings.leader_election:
                from sgdjob_operator.k8s.election import run_elected

                await run_elected(settings, run_kopf)  # a standby until it holds the Lease
            else:
                await run_kopf()

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(serve())  # what kopf.run does, with the webhook around it
    if unresolved.seen:
        raise click.ClickException(UNRESOLVED_EXIT)


UNRESOLVED_EXIT = (
    "kopf resolved no SGDJob resource from API discovery, and would serve no job until a CRD changes: "
    "exiting so that the operator starts again (its pod restarts; a standby takes the lease meanwhile)"
)


def names_our_resource(message: str) -> bool:
    """kopf's warning that it serves none of the SGDJob resource (pure)."""
    from sgdjob_operator.api.models import PLURAL

    return message.startswith("Unresolved resources cannot be served") and f"'{PLURAL}'" in message


class UnresolvedWatch(logging.Handler):
    """Stops kopf when it says it cannot serve SGDJobs. kopf resolves its resources from discovery once
    at its start and again only when a CRD changes; after an API server restart whose discovery did
    not list the SGDJob group yet, a leader that went on served no job for good (clean CI, chaos case
    d: six real-node cases failed after it). The startup waits for discovery first
    (k8s.handlers.wait_for_crd); this is the net for whatever that wait cannot see."""

    def __init__(self, stop: Callable[[], None] = lambda: signal.raise_signal(signal.SIGTERM)) -> None:
        super().__init__(logging.WARNING)
        self.armed = False  # kopf runs
        self.seen = False
        self._stop = stop  # kopf stops on SIGTERM as on a rolling update's: the lease is handed back

    def emit(self, record: logging.LogRecord) -> None:
        if self.armed and not self.seen and names_our_resource(record.getMessage()):
            self.seen = True
            logging.getLogger("sgdjob_operator").error(UNRESOLVED_EXIT)
            self._stop()


def use_service_account_dir(folder: str) -> None:
    """Point the official client's in-cluster loader at a service-account folder mounted elsewhere."""
    from kubernetes.config import incluster_config

    incluster_config.SERVICE_TOKEN_FILENAME = os.path.join(folder, "token")
    incluster_config.SERVICE_CERT_FILENAME = os.path.join(folder, "ca.crt")
