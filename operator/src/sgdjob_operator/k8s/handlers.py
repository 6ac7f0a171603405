"""Thin kopf handlers: they only wire events to the controller's passes. Importing this module
registers them (the CLI imports it; `kopf run -m sgdjob_operator.k8s` does through the package).

- one `on.startup` applies every setting; `on.login` gives kopf the operator's own credentials;
- `on.create/resume/update(spec)` validate the spec (PermanentError naming the field when the
  cross-field rules refuse it) and create the job's Service, Secret and ConfigMap;
- one loop per SGDJob (started from its events) runs the level-based passes (pods, status,
  monitor), woken early by events on the job or its pods, otherwise every policy interval or resync;
- a DELETED event removes what garbage collection would (for clusters without it) and the memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from sgdjob_operator.api.models import GROUP, PLURAL, VERSION
from sgdjob_operator.api.validation import SpecError, validate_spec
from sgdjob_operator.k8s import metrics
from sgdjob_operator.k8s.builders import LABEL_JOB, JobRef
from sgdjob_operator.k8s.client import ApiError, Credentials, Kube, core_path, pods_path
from sgdjob_operator.k8s.publish import post_events
from sgdjob_operator.k8s.reconcile import reconcile
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.settings import current
from sgdjob_operator.k8s.status import dump_status, load_status, mark_invalid

log = logging.getLogger("sgdjob_operator")
PREFIX = "sgdjob.dev"


class SpecDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff base, built without first deep-copying the status and the managed
    fields it then throws away. Every event on a job (our own status writes included) builds
    one, and the copy of a long status was a quarter of the operator's CPU with 100 new jobs."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        if extra_fields:  # a handler that watches status fields needs them copied: kopf's own way
            return super().build(body=body, extra_fields=extra_fields)
        lean = {k: v for k, v in body.items() if k not in ("status", "metadata")}
        lean["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
        return super().build(body=kopf.Body(lean), extra_fields=extra_fields)  # type: ignore[arg-type]


class _State:
    runtime: Runtime | None = None
    credentials: Credentials | None = None


def runtime() -> Runtime:
    if _State.runtime is None:
        raise kopf.TemporaryError("operator is still starting", delay=1)
    return _State.runtime


def _credentials() -> Credentials:
    if _State.credentials is None:
        cfg = current()
        _State.credentials = Credentials.load(cfg.kubeconfig, cfg.context)
    return _State.credentials


@kopf.on.login(errors=kopf.ErrorsMode.PERMANENT)
def login(**_: Any) -> kopf.ConnectionInfo:
    c = _credentials()
    return kopf.ConnectionInfo(
        server=c.server,
        ca_path=c.ca_file,
        insecure=c.insecure,
        scheme="Bearer" if c.token else None,
        token=c.bearer(),
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
    )


CRD_WAIT_S = 120.0


def discovery_lists(groups: Mapping[str, Any] | None, resources: Mapping[str, Any] | None) -> bool:
    """API discovery lists the SGDJob resource as kopf looks it up: the group list (`/apis`) names
    GROUP at VERSION, and that version's resource list names PLURAL (pure)."""
    listed = any(
        g.get("name") == GROUP and any(v.get("version") == VERSION for v in g.get("versions") or [])
        for g in (groups or {}).get("groups") or []
    )
    return listed and any(r.get("name") == PLURAL for r in (resources or {}).get("resources") or [])


async def wait_for_crd(kube: Kube, timeout: float = CRD_WAIT_S) -> None:
    """Return once API discovery lists the SGDJob resource. kopf looks its resources up in discovery
    once, after startup, and only looks again when a CRD changes: an operator that starts while an API
    server just back up does not list the CRD's resources yet serves no SGDJob, for good (seen in the
    chaos suite after an API server restart: kopf's "Unresolved resources cannot be served"). kopf
    reads the group list first, then each group's versions: a restarted API server served
    `/apis/GROUP/VERSION` before its `/apis` listed the group again (clean CI, 2026-12-06), so both
    are asked. Past `timeout` the CRD is missing, not late: startup fails saying so, and kopf tries it
    again a minute later."""
    deadline = time.monotonic() + timeout
    path = f"/apis/{GROUP}/{VERSION}"
    while True:
        try:
            groups, found = await kube.get("/apis"), await kube.get(path)
        except (ApiError, ValueError) as err:  # coming up; an unknown group's 404 is plain text, not JSON
            log.info("waiting for the API server to list %s: %s", path, err)
            groups, found = None, None
        if discovery_lists(groups, found):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the API server does not serve {PLURAL}.{GROUP}/{VERSION} after {timeout:.0f}s: install the "
                "SGDJob CRD first (kubectl apply -f crds/, or the Helm chart's crds/)"
            )
        await asyncio.sleep(1.0)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    cfg = current()
    # Handler progress and the last-handled spec live in annotations: status belongs to our model.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = SpecDiffBase(prefix=PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    # Our own Events carry the decisions; kopf adds one only for warnings and errors in handlers.
    settings.posting.level = logging.WARNING
    # Re-list periodically so a silently dropped watch cannot leave a job unwatched.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.batching.worker_limit = 1000
    settings.execution.max_workers = 8
    kube = Kube(_credentials(), max_connections=cfg.api_concurrency)
    await wait_for_crd(kube)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
    _State.runtime = Runtime(settings=cfg, kube=kube, http=http)
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port, cfg.metrics_host)
    metrics.LEADER.set(1)  # startup runs only in the replica that acts
    log.info(
        "sgdjob operator started: namespaces %s, trainer image %s", ",".join(cfg.namespaces) or "all", cfg.trainer_image
    )


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    rt = _State.runtime
    if rt is not None:
        for task in rt.loops.values():
            task.cancel()
        await asyncio.gather(*rt.loops.values(), return_exceptions=True)
        await rt.kube.close()
        await rt.http.close()
        _State.runtime = None


@kopf.on.probe(id="jobs")
def probe(**_: Any) -> int:
    """Liveness detail: how many jobs this operator is reconciling."""
    return len(_State.runtime.loops) if _State.runtime else 0


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def admit(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Validate: an invalid spec is Failed at once, with kopf's PermanentError in the operator's log.
    The job's pass (`reconcile`), woken by the same watch event, creates or updates the job's fixed
    objects before any pod, for every new generation: doing it here too raced it and did it twice."""
    rt = runtime()
    ref = JobRef.from_body(dict(body))
    status = load_status(dict(body.get("status") or {}))
    try:
        validate_spec(dict(body["spec"]))
    except SpecError as err:
        events = mark_invalid(status, err.problems, time.time())
        patch.status.update(dump_status(status))
        await post_events(rt, ref, events)
        raise kopf.PermanentError("; ".join(err.problems)) from err


async def job_loop(rt: Runtime, ref: JobRef) -> None:
    """The per-job daemon: level-based passes until the job is gone. Our own task rather than a
    kopf daemon, because kopf puts a finalizer on every object with a daemon, and a finalizer would
    block `kubectl delete` (and garbage collection) whenever the operator is not running."""
    key = (ref.namespace, ref.name)
    wake = rt.wakeups.setdefault(key, asyncio.Event())
    failures = 0
    while True:
        wake.clear()
        try:
            delay = await reconcile(rt, ref)
            failures = 0
        except ApiError as err:
            failures += 1
            metrics.RECONCILE_ERRORS.inc()
            delay = min(60.0, 0.5 * 2**failures)
            log.warning("%s/%s: pass failed (retry in %.1fs): %s", ref.namespace, ref.name, delay, err)
        except Exception:
            failures += 1
            metrics.RECONCILE_ERRORS.inc()
            delay = min(60.0, 0.5 * 2**failures)
            log.exception("%s/%s: pass failed (retry in %.1fs)", ref.namespace, ref.name, delay)
        if delay is None:
            return  # the job is gone or being deleted
        await asyncio.sleep(rt.settings.min_tick_s)  # a burst of events becomes one pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=max(0.0, delay - rt.settings.min_tick_s))


def _supervise(rt: Runtime, ref: JobRef, generation: int | None) -> None:
    """One loop per job (by UID: a job deleted and re-created under its name gets a fresh one). A
    new loop's first pass handles at least `generation`: it counts as handled from the start, so
    the events of our own first writes (kopf's annotations, status) do not ask for a second pass."""
    key = (ref.namespace, ref.name)
    task = rt.loops.get(key)
    if task is not None and not task.done() and task.get_name() == ref.uid:
        return
    if task is not None:
        task.cancel()
    if generation is not None:
        rt.generations[key] = generation
    rt.loops[key] = asyncio.create_task(job_loop(rt, ref), name=ref.uid)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(
    *, event: kopf.RawEvent, name: str, namespace: str | None, uid: str, meta: kopf.Meta, **_: Any
) -> None:
    """Every event on an SGDJob (the initial listing included, so a restarted operator adopts every
    job): keep its loop running, wake it for a new generation, clean up after a deletion."""
    rt = _State.runtime
    if rt is None:
        return
    ref = JobRef(name=name, namespace=namespace or "default", uid=uid)
    key = (ref.namespace, ref.name)
    if event["type"] == "DELETED":
        task = rt.loops.pop(key, None)
        if task is not None:
            task.cancel()
        rt.forget(key, uid)
        await _delete_children(rt, ref)
        return
    generation = meta.get("generation")
    _supervise(rt, ref, generation)
    # Our own status writes come back as events too; only a new generation (spec) needs a pass.
    if generation != rt.generations.get(key):
        rt.wake(key)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(*, event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    """Wake the pod's job when something a pass acts on changed (async: in the event loop, where
    the wake-up is safe; a sync handler would run in a thread)."""
    rt = _State.runtime
    if rt is not None and rt.pod_changed(event["type"] or "", dict(event["object"])):
        rt.wake((namespace or "default", str(labels[LABEL_JOB])))


async def _delete_children(rt: Runtime, ref: JobRef) -> None:
    """What the garbage collector does through ownerReferences, done directly so a cluster without a
    running GC (or a slow one) is cleaned too. Every step tolerates 'already gone'."""
    try:
        for pod in await rt.kube.list_objects(pods_path(ref.namespace), ref.selector):
            owners = pod["metadata"].get("ownerReferences") or []
            if any(o.get("uid") == ref.uid for o in owners):
                await rt.kube.delete("Pod", ref.namespace, pod["metadata"]["name"], grace_s=5)
        for kind, plural, obj_name in (
            ("Service", "services", ref.service),
            ("Secret", "secrets", ref.secret),
            ("ConfigMap", "configmaps", ref.config_map),
            ("ConfigMap", "configmaps", ref.policy_state),
        ):
            obj = await rt.kube.get(f"{core_path(ref.namespace, plural)}/{obj_name}")
            if obj and any(o.get("uid") == ref.uid for o in obj["metadata"].get("ownerReferences") or []):
                await rt.kube.delete(kind, ref.namespace, obj_name)
    except ApiError as err:
        log.warning("%s/%s: clean-up incomplete (garbage collection finishes it): %s", ref.namespace, ref.name, err)
