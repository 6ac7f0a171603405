"""Readiness probes a kubelet would run against a pod's IP: tcpSocket and httpGet.

exec probes are not run (they count as passing); liveness and startup probes are not run at all.
Readiness matters here because Services (and so the pods' DNS names) only list Ready pods.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from typing import Any

Obj = dict[str, Any]


def _port(value: int | str, container: Obj) -> int:
    """A probe's port: a number or the name of one of the container's ports."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"no container port named {value!r}")


def check(probe: Obj, container: Obj, pod_ip: str, timeout: float = 1.0) -> bool:
    """One probe attempt; True when it passes (or is an exec probe, which is not emulated)."""
    try:
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            with socket.create_connection(
                (spec.get("host") or pod_ip, _port(spec["port"], container)), timeout=timeout
            ):
                return True
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host, port = spec.get("host") or pod_ip, _port(spec["port"], container)
            if spec.get("scheme", "HTTP").upper() == "HTTPS":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ssl._create_unverified_context()
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
                conn.request("GET", spec.get("path") or "/", headers=headers)
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
    except (OSError, ValueError, http.client.HTTPException):
        return False
    return True
