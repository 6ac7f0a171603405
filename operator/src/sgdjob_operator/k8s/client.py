"""The operator's one Kubernetes API wrapper: async (aiohttp, the same client stack as kopf and the
scraper), raw JSON (no model (de)serialisation cost per object), idempotent by construction:
create tolerates 409 AlreadyExists and delete tolerates 404 NotFound, so any step may be re-run.

Credentials come from the in-cluster service account or a kubeconfig, loaded once by the official
client's loaders; kopf is given the same credentials by the login handler.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from sgdjob_operator.api.models import GROUP, PLURAL, VERSION
from sgdjob_operator.k8s.builders import JobRef, owner_reference

MERGE = "application/merge-patch+json"
SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
EVENT_SOURCE = "sgdjob-operator"


class ApiError(RuntimeError):
    """A Kubernetes API answer that is not success (and not a tolerated 409/404)."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        try:
            detail = json.loads(body).get("message", body)
        except ValueError:
            detail = body
        super().__init__(f"{method} {path}: HTTP {status}: {str(detail)[:500]}")

    @property
    def retriable(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


@dataclass(frozen=True, slots=True)
class Credentials:
    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    token_file: str | None = None

    @classmethod
    def load(cls, kubeconfig: str | None = None, context: str | None = None) -> Credentials:
        """In-cluster when there is no kubeconfig to read and the service account is mounted."""
        from kubernetes import client, config

        cfg = client.Configuration()
        if kubeconfig is None:
            try:
                config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg, context=context)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, context=context)  # type: ignore[no-untyped-call]
        keys = cfg.api_key or {}
        auth = (
            keys.get("authorization") or keys.get("BearerToken") or ""
        )  # the key's name differs between client versions
        token = auth.split(" ", 1)[1] if " " in auth else auth or None
        token_file = (
            SA_TOKEN
            if kubeconfig is None and os.path.exists(SA_TOKEN) and cfg.host.startswith("https://kubernetes")
            else None
        )
        return cls(
            server=cfg.host.rstrip("/"),
            token=token,
            ca_file=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
            insecure=not cfg.verify_ssl,
            token_file=token_file,
        )

    def bearer(self) -> str | None:
        """The token now: a mounted service-account token is rotated by the kubelet, so re-read it."""
        if self.token_file:
            try:
                with open(self.token_file, encoding="utf-8") as f:
                    return f.read().strip() or self.token
            except OSError:
                return self.token
        return self.token

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def pods_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/pods"


def job_path(ns: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"
    return f"{base}/{name}" if name else base


def core_path(ns: str, kind_plural: str) -> str:
    return f"/api/v1/namespaces/{ns}/{kind_plural}"


PLURALS = {"Pod": "pods", "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps"}


class Kube:
    """A small async API client bound to one set of credentials."""

    def __init__(self, credentials: Credentials, *, timeout_s: float = 30.0, max_connections: int = 32) -> None:
        self.credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._limit = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._bearer: str | None = None
        self._bearer_at: float | None = None

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json", "User-Agent": EVENT_SOURCE}
            connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context(), limit=self._limit)
            self._session = aiohttp.ClientSession(
                base_url=None, headers=headers, connector=connector, timeout=self._timeout
            )
        return self._session

    def _token(self) -> str | None:
        now = time.monotonic()
        if self._bearer_at is None or now - self._bearer_at > 60.0:
            self._bearer, self._bearer_at = self.credentials.bearer(), now
        return self._bearer

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        ok: tuple[int, ...] = (),
        decode: bool = True,
    ) -> tuple[int, Any]:
        """One call; returns (status, decoded JSON or None without `decode`). Statuses in `ok` are
        returned, not raised."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with self._sess().request(
                method, self.credentials.server + path, data=data, params=params, headers=headers
            ) as resp:
                text = await resp.text()
                if resp.status < 300 or resp.status in ok:
                    return resp.status, json.loads(text) if text and decode else None
                raise ApiError(resp.status, method, path, text)
        except (TimeoutError, aiohttp.ClientError) as err:
            raise ApiError(0, method, path, f"{type(err).__name__}: {err}") from err

    # ------------------------------------------------------------------ idempotent verbs

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create a namespaced core object; False when it already exists (409). The stored object
        the API server returns is not decoded: nothing reads it, and with many new jobs the JSON
        decoding of every created pod was a noticeable share of the operator's CPU."""
        ns = obj["metadata"]["namespace"]
        status, _ = await self.request("POST", core_path(ns, PLURALS[obj["kind"]]), obj, ok=(409,), decode=False)
        return status != 409

    async def create_at(self, collection: str, obj: dict[str, Any]) -> bool:
        """Create any object (a custom resource) in its collection path; False when it exists (409)."""
        status, _ = await self.request("POST", collection, obj, ok=(409,))
        return status != 409

    async def delete_at(self, path: str) -> bool:
        """Delete any object by its path; False when it was already gone (404)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        status, _ = await self.request("DELETE", path, body, ok=(404,))
        return status != 404

    async def delete(self, kind: str, ns: str, name: str, *, grace_s: int | None = None) -> bool:
        """Delete; False when it was already gone (404). Background propagation: GC removes dependents."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_s is not None:
            body["gracePeriodSeconds"] = grace_s
        status, _ = await self.request("DELETE", f"{core_path(ns, PLURALS[kind])}/{name}", body, ok=(404,))
        return status != 404

    async def get(self, path: str, *, cached: bool = False) -> dict[str, Any] | None:
        """None when it does not exist. `cached`: from the API server's watch cache (see list_objects)."""
        status, obj = await self.request("GET", path, params={"resourceVersion": "0"} if cached else None, ok=(404,))
        return None if status == 404 else obj

    async def list_objects(
        self, path: str, label_selector: str | None = None, *, cached: bool = False
    ) -> list[dict[str, Any]]:
        """`cached`: served from the API server's watch cache (resourceVersion=0) instead of a quorum
        read from etcd: as fresh as the watch events we have seen, and without decoding every object
        of the namespace in etcd for each call (a LIST per pass is otherwise quadratic in the jobs)."""
        params = {"labelSelector": label_selector} if label_selector else {}
        if cached:
            params["resourceVersion"] = "0"
        _, obj = await self.request("GET", path, params=params or None)
        items: list[dict[str, Any]] = obj.get("items") or []
        return items

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch; None when the object is gone (404)."""
        status, obj = await self.request("PATCH", path, patch, content_type=MERGE, ok=(404,))
        return None if status == 404 else obj

    # ------------------------------------------------------------------ SGDJob helpers

    async def get_job(self, job: JobRef) -> dict[str, Any] | None:
        return await self.get(job_path(job.namespace, job.name))

    async def patch_job_status(self, job: JobRef, status: dict[str, Any]) -> dict[str, Any] | None:
        return await self.patch(job_path(job.namespace, job.name) + "/status", {"status": status})

    async def scale_job(self, job: JobRef, replicas: int) -> dict[str, Any] | None:
        """Set spec.replicas, the field `kubectl scale` sets through the scale subresource (patched on
        the object itself so the operator needs no extra RBAC verb for sgdjobs/scale)."""
        return await self.patch(job_path(job.namespace, job.name), {"spec": {"replicas": replicas}})

    async def delete_job(self, job: JobRef) -> bool:
        status, _ = await self.request(
            "DELETE", job_path(job.namespace, job.name), {"propagationPolicy": "Background"}, ok=(404,)
        )
        return status != 404

    async def get_node(self, name: str) -> dict[str, Any] | None:
        """A Node from the watch cache (cluster-scoped; the chart's ClusterRole grants `get`)."""
        return await self.get(f"/api/v1/nodes/{name}", cached=True)

    async def job_pods(self, job: JobRef, *, cached: bool = False) -> list[dict[str, Any]]:
        return await self.list_objects(pods_path(job.namespace), job.selector, cached=cached)

    async def post_event(self, job: JobRef, type_: str, reason: str, message: str) -> None:
        """An Event about the job, as `kubectl describe sgdjob` shows them."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ref = {**owner_reference(job), "namespace": job.namespace}
        for key in ("controller", "blockOwnerDeletion"):
            ref.pop(key)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{job.name}.{uuid.uuid4().hex[:12]}", "namespace": job.namespace},
            "involvedObject": ref,
            "type": type_,
            "reason": reason[:128],
            "message": message[:1024],
            "source": {"component": EVENT_SOURCE},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": EVENT_SOURCE,
        }
        await self.request("POST", core_path(job.namespace, "events"), event, ok=(409,))
