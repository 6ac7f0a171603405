"""The objects every job owns besides its pods: the rendezvous Service, the token Secret and the
run-config ConfigMap; created with the job and re-asserted on resync."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time

from sgdjob_operator.api.models import SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.builders import (
    TOKEN_KEY,
    JobRef,
    build_config_map,
    build_secret,
    build_service,
)
from sgdjob_operator.k8s.client import ApiError, core_path
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_trainer.config import SyncMode


async def ensure_children(
    rt: Runtime, ref: JobRef, spec: SGDJobSpec, status: SGDJobStatus, *, reassert: bool = False
) -> None:
    """Service, token Secret and run-config ConfigMap: created if missing; the ConfigMap is kept at
    the mode a restarted world should start in (the target mode). `reassert`: the periodic check of
    objects made before, read from the watch cache and written only where missing or different (a
    create answered 409 for each of them costs the API server a write attempt, every job, every resync)."""
    rt.last_ensure[ref.uid] = time.monotonic()  # when the periodic re-assertion is due next
    mode = status.target_mode or spec.initial_mode.value
    config_map = build_config_map(ref, spec, SyncMode(mode))
    config_path = f"{core_path(ref.namespace, 'configmaps')}/{ref.config_map}"
    try:
        if reassert:
            service, secret, current = await asyncio.gather(
                rt.kube.get(f"{core_path(ref.namespace, 'services')}/{ref.service}", cached=True),
                rt.kube.get(f"{core_path(ref.namespace, 'secrets')}/{ref.secret}", cached=True),
                rt.kube.get(config_path, cached=True),
            )
            if service is None:
                await rt.kube.create(build_service(ref))
            if secret is None:
                rt.tokens.pop(ref.uid, None)  # a new token: pods that mount the new Secret expect it
                await rt.kube.create(build_secret(ref, secrets.token_urlsafe(32)))
            if current is None:
                await rt.kube.create(config_map)  # a 409 from a stale cache: patched next time
            elif current.get("data") != config_map["data"]:
                await rt.kube.patch(config_path, {"data": config_map["data"]})
            return
        _, _, fresh = await asyncio.gather(
            rt.kube.create(build_service(ref)),
            rt.kube.create(build_secret(ref, secrets.token_urlsafe(32))),
            rt.kube.create(config_map),
        )
        if not fresh:
            await rt.kube.patch(config_path, {"data": config_map["data"]})
    except ApiError:
        rt.last_ensure.pop(ref.uid, None)  # the next pass tries again
        raise


async def job_token(rt: Runtime, ref: JobRef) -> str | None:
    if ref.uid not in rt.tokens:
        secret = await rt.kube.get(f"{core_path(ref.namespace, 'secrets')}/{ref.secret}")
        data = (secret or {}).get("data") or {}
        if TOKEN_KEY not in data:
            return None
        rt.tokens[ref.uid] = base64.b64decode(data[TOKEN_KEY]).decode().strip()
    return rt.tokens[ref.uid]
