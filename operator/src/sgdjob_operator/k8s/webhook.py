"""The validating admission webhook: the model's cross-field rules (minReplicas <= replicas <= maxReplicas
and the like) checked by the API server before an SGDJob is stored, so `kubectl apply` refuses a bad
job with the field named instead of the job turning Failed afterwards.

Served by our own small TLS server (aiohttp), not kopf's, from the moment the process starts until it
stops, whatever its role: a standby answers as the leader does, and taking the Lease (which starts
kopf) never closes the port. With kopf's server the port was shut between the standby's and kopf's,
and every admission the Service sent there in that second failed (`connection refused`: a `kubectl
patch` of any SGDJob refused, failurePolicy Fail). The ValidatingWebhookConfiguration is shipped by
the Helm chart (or written by whoever runs the operator), pointing at path `/validate`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any

import kopf
from aiohttp import web

from sgdjob_operator.api.names import name_problem
from sgdjob_operator.api.validation import SpecError, spec_warnings, validate_spec
from sgdjob_operator.k8s.settings import OperatorSettings

log = logging.getLogger("sgdjob_operator")
PATH = "/validate"  # what the chart's ValidatingWebhookConfiguration names


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


def check(cfg: OperatorSettings) -> str | None:
    """What is wrong with the webhook settings, or None."""
    if not cfg.webhook_port:
        return "--webhook-cert/--webhook-key need --webhook-port" if cfg.webhook_cert or cfg.webhook_key else None
    if not (cfg.webhook_cert and cfg.webhook_key):
        return "--webhook-port needs --webhook-cert and --webhook-key (the API server only calls webhooks over TLS)"
    return None


def admission_response(request: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview answer to `request`: allowed with `review`'s warnings (kubectl prints them),
    or refused with its message and code."""
    req = dict(request.get("request") or {})
    obj, old = req.get("object") or {}, req.get("oldObject")
    name = req.get("name") or (obj.get("metadata") or {}).get("name")
    answer: dict[str, Any] = {"uid": req.get("uid", ""), "allowed": True}
    try:
        warnings = review(obj.get("spec"), (old.get("spec") or {}) if old else None, name=name)
        if warnings:
            answer["warnings"] = warnings
    except kopf.AdmissionError as err:
        answer = {**answer, "allowed": False, "status": {"message": str(err), "code": err.code or 500}}
    return {
        "apiVersion": request.get("apiVersion", "admission.k8s.io/v1"),
        "kind": request.get("kind", "AdmissionReview"),
        "response": answer,
    }


async def _validate(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return web.json_response({"error": "not an AdmissionReview"}, status=400)
    return web.json_response(admission_response(body))


@contextlib.asynccontextmanager
async def serving(cfg: OperatorSettings) -> AsyncIterator[None]:
    """Serve the webhook over TLS while the block runs (nothing when no port is configured)."""
    if not cfg.webhook_port or not cfg.webhook_cert or not cfg.webhook_key:
        yield
        return
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cfg.webhook_cert, cfg.webhook_key)
    app = web.Application()
    app.router.add_post(PATH, _validate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.webhook_addr, cfg.webhook_port, ssl_context=tls).start()
        log.info("admission webhook on https://%s:%d%s", cfg.webhook_addr, cfg.webhook_port, PATH)
        yield
    finally:
        await runner.cleanup()
