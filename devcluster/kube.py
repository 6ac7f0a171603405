"""A small raw-JSON Kubernetes API client for the tests on the local cluster and the benchmarks.

Credentials come from the official client's kubeconfig loader; requests go straight through urllib3
(thread-safe pools). Why not the generated API classes: the installed client (v37) validates every
call with pydantic models and defaults PATCH to JSON-patch, while the tests want exactly the wire
JSON (camelCase dicts, as `kubectl get -o json` shows) and strategic-merge patches, cheaply, on a
2-core machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlparse

import urllib3
from kubernetes import client, config

from sgdjob_operator.k8s.client import ApiError

Obj = dict[str, Any]
PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


# The operator's own error type for a non-2xx answer, so the harness and the operator read API
# failures the same way (`status` is the HTTP code; 0 when the server could not be reached).
KubeError = ApiError


class KubeApi:
    """`KubeApi(kubeconfig).get("/api/v1/nodes")`; every method returns the decoded JSON body."""

    def __init__(self, kubeconfig: Path | str, timeout: float = 30.0, ca_file: Path | None = None) -> None:
        """`ca_file` verifies the server even where the kubeconfig skips verification (the local plane's
        kubeconfig does; its self-signed bundle is certs/apiserver.crt), which also keeps urllib3 quiet.
        """
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)  # type: ignore[no-untyped-call]
        self.server = str(cfg.host).rstrip("/")
        self.port = urlparse(self.server).port or 443
        self.timeout = timeout
        self.headers = {"Accept": "application/json", "User-Agent": "sgdjob-devcluster-node-agent"}
        for key in ("BearerToken", "authorization"):  # the key's name differs between client versions
            auth = (cfg.api_key or {}).get(key)
            if auth:
                prefix = (cfg.api_key_prefix or {}).get(key)
                self.headers["Authorization"] = (
                    f"{prefix} {auth}" if prefix else (auth if " " in auth else f"Bearer {auth}")
                )
                break
        verify = bool(cfg.verify_ssl or ca_file)
        if not verify:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        self.pool = urllib3.PoolManager(
            num_pools=2,
            maxsize=64,
            cert_reqs="CERT_REQUIRED" if verify else "CERT_NONE",
            ca_certs=str(ca_file) if ca_file else cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
        )

    def _url(self, path: str, params: dict[str, Any] | None) -> str:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self.server + path + ("?" + urlencode(query) if query else "")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        headers = dict(self.headers)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            resp = self.pool.request(
                method, self._url(path, params), body=data, headers=headers, timeout=self.timeout, retries=False
            )
        except urllib3.exceptions.HTTPError as err:
            raise KubeError(0, method, path, str(err)) from err
        text = resp.data.decode(errors="replace")
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, method, path, text)
        return json.loads(text) if text else {}

    def get(self, path: str, **params: Any) -> Obj:
        return self.request("GET", path, params=params)

    def get_or_none(self, path: str) -> Obj | None:
        try:
            return self.get(path)
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any, kind: str = "strategic") -> Obj:
        return self.request("PATCH", path, body, content_type=PATCH_TYPES[kind])

    def delete(self, path: str, body: Obj | None = None, missing_ok: bool = True) -> Obj:
        try:
            return self.request("DELETE", path, body)
        except KubeError as err:
            if missing_ok and err.status == 404:
                return {}
            raise

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 5) -> Iterator[Obj]:
        """Events ({"type", "object"}) from `resource_version` on, until the server ends the watch."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout_seconds,
            "allowWatchBookmarks": "true",
        }
        timeout = urllib3.Timeout(connect=5.0, read=timeout_seconds + 10.0)
        try:
            resp = self.pool.request(
                "GET",
                self._url(path, params),
                headers=self.headers,
                preload_content=False,
                timeout=timeout,
                retries=False,
            )
        except urllib3.exceptions.HTTPError as err:
            raise KubeError(0, "WATCH", path, str(err)) from err
        try:
            if resp.status != 200:
                raise KubeError(resp.status, "WATCH", path, resp.read().decode(errors="replace"))
            buf = b""
            for chunk in resp.stream(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            resp.release_conn()


def pod_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")
