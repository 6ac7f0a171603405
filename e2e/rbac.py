"""What a service account asked the API server for, read from the real-node cluster's audit log
(devcluster/realconf.AUDIT_POLICY): each request as the authorizer names it, (apiGroup,
resource[/subresource], verb), with the answer's status code. The Helm tier holds the operator's
requests against the chart's RBAC: nothing refused, nothing granted that the operator never uses."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

Permission = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)


@dataclass(frozen=True, slots=True)
class Request:
    user: str
    permission: Permission
    code: int
    uri: str


def audit_size(path: Path) -> int:
    """Where the log ends now: `read_audit(path, since=...)` reads what comes after."""
    return path.stat().st_size if path.exists() else 0


def read_audit(path: Path, since: int = 0) -> Iterator[dict[str, object]]:
    """The audit log's events from byte `since` on; a line the API server was still writing is skipped."""
    with path.open(encoding="utf-8") as log:
        log.seek(since)
        for line in log:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                yield event


def requests(events: Iterable[dict[str, object]], user_prefix: str) -> list[Request]:
    """The resource requests of users whose name starts with `user_prefix` (discovery and other
    non-resource URLs left out). A watch is there from its ResponseStarted stage on: kopf's watches
    stay open for the API server's request timeout (30 to 60 minutes), longer than a test."""
    out = []
    for event in events:
        user = event.get("user")
        ref = event.get("objectRef")
        name = str(user.get("username", "")) if isinstance(user, dict) else ""
        if not name.startswith(user_prefix) or not isinstance(ref, dict):
            continue
        resource = str(ref.get("resource", ""))
        if ref.get("subresource"):
            resource += f"/{ref['subresource']}"
        status = event.get("responseStatus")
        code = int(status.get("code", 0)) if isinstance(status, dict) else 0
        permission = (str(ref.get("apiGroup", "")), resource, str(event.get("verb", "")))
        out.append(Request(name, permission, code, str(event.get("requestURI", ""))))
    return out


def used(found: Iterable[Request]) -> set[Permission]:
    return {r.permission for r in found}


def denied(found: Iterable[Request]) -> list[Request]:
    """Requests the authorizer refused (403)."""
    return [r for r in found if r.code == 403]
