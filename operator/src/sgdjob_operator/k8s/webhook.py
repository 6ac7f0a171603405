"""The validating admission webhook: the model's cross-field rules (minReplicas <= replicas <= maxReplicas
and the like) checked by the API server before an SGDJob is stored, so `kubectl apply` refuses a bad
job with the field named instead of the job turning Failed afterwards.

kopf serves it (`settings.admission.server`); the ValidatingWebhookConfiguration is not managed by
kopf but shipped by the Helm chart (or written by whoever runs the operator), pointing at path
`/validate` (kopf routes `POST /<handler id>`). Registered only when a port is configured: kopf
refuses to start with admission handlers but no server.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from sgdjob_operator.api.models import GROUP, PLURAL, VERSION
from sgdjob_operator.api.names import name_problem
from sgdjob_operator.api.validation import SpecError, spec_warnings, validate_spec
from sgdjob_operator.k8s.settings import OperatorSettings

log = logging.getLogger("sgdjob_operator")
HANDLER_ID = "validate"
PATH = f"/{HANDLER_ID}"


def review(spec: dict[str, Any] | None, old_spec: dict[str, Any] | None, name: str | None = None) -> list[str]:
    """Raise kopf.AdmissionError naming the fields when the spec breaks the model's rules, or when a
    new job's name cannot name the objects the operator makes for it (`api.names`). An update that
    leaves the spec as it was (metadata, finalizers, annotations) always passes, so a job stored
    before the webhook existed can still be patched, labelled and deleted. Returns the warnings a
    valid spec earns (`api.validation.spec_warnings`): kubectl prints them, the job is stored."""
    if old_spec is not None and old_spec == spec:
        return []
    problems: list[str] = []
    if old_spec is None and name and (problem := name_problem(name)) is not None:
        problems.append(f"metadata.name: {problem}")
    try:
        valid = validate_spec(dict(spec or {}))
    except SpecError as err:
        problems += err.problems
    if problems:
        raise kopf.AdmissionError("invalid SGDJob: " + "; ".join(problems), code=422)
    return [w.message for w in spec_warnings(valid)]


def _validate(spec: kopf.Spec, warnings: list[str], **kwargs: Any) -> None:
    old = kwargs.get("old")  # the stored object on UPDATE (kopf passes it; not in WebhookFn's signature)
    warnings += review(dict(spec), dict(old.get("spec") or {}) if old else None, name=kwargs.get("name"))


async def _serve(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Startup: give kopf the webhook server (read when its admission task starts, after startup)."""
    cfg = _Config.value
    if cfg is None:
        return
    settings.admission.server = kopf.WebhookServer(
        addr=cfg.webhook_addr, port=cfg.webhook_port, certfile=cfg.webhook_cert, pkeyfile=cfg.webhook_key
    )
    settings.admission.managed = None  # the chart owns the ValidatingWebhookConfiguration
    log.info("admission webhook on https://%s:%d%s", cfg.webhook_addr, cfg.webhook_port, PATH)


class _Config:
    value: OperatorSettings | None = None


def check(cfg: OperatorSettings) -> str | None:
    """What is wrong with the webhook settings, or None."""
    if not cfg.webhook_port:
        return "--webhook-cert/--webhook-key need --webhook-port" if cfg.webhook_cert or cfg.webhook_key else None
    if not (cfg.webhook_cert and cfg.webhook_key):
        return "--webhook-port needs --webhook-cert and --webhook-key (the API server only calls webhooks over TLS)"
    return None


def register(cfg: OperatorSettings, registry: kopf.OperatorRegistry | None = None) -> bool:
    """Register the validating handler and the server's startup hook when the webhook is on."""
    if not cfg.webhook_port:
        return False
    _Config.value = cfg
    reg = registry or kopf.get_default_registry()
    kopf.on.validate(GROUP, VERSION, PLURAL, id=HANDLER_ID, operations=["CREATE", "UPDATE"], registry=reg)(_validate)
    kopf.on.startup(id="webhook-server", registry=reg)(_serve)
    return True
