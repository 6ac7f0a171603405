"""The audit log read as permissions (e2e/rbac.py), on events shaped as kube-apiserver 1.20 writes them:
what the real-node Helm tier holds against the chart's RBAC."""

from __future__ import annotations

import json
from pathlib import Path

from e2e import rbac

OP = "system:serviceaccount:sgdjob-system:sgdjob-operator"


def _event(user: str, verb: str, ref: dict[str, str] | None, code: int, stage: str = "ResponseComplete") -> str:
    doc: dict[str, object] = {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "Metadata",
        "stage": stage,
        "requestURI": "/x",
        "verb": verb,
        "user": {"username": user, "groups": ["system:serviceaccounts"]},
        "responseStatus": {"metadata": {}, "code": code},
    }
    if ref is not None:
        doc["objectRef"] = ref
    return json.dumps(doc)


def test_the_operators_requests_become_group_resource_verb_and_refusals_are_found(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = [
        _event(OP, "create", {"resource": "pods", "namespace": "a", "apiVersion": "v1"}, 201),
        _event(OP, "patch", {"resource": "sgdjobs", "subresource": "status", "apiGroup": "sgdjob.dev"}, 200),
        # A watch still open shows only its ResponseStarted stage.
        _event(OP, "watch", {"resource": "leases", "apiGroup": "coordination.k8s.io"}, 200, "ResponseStarted"),
        _event(OP, "get", None, 200),  # discovery: no object
        _event("system:serviceaccount:jobs:default", "list", {"resource": "secrets"}, 200),  # another account
        _event(OP, "delete", {"resource": "nodes"}, 403),
    ]
    log.write_text("\n".join(lines) + "\n" + '{"kind": "Event", "verb": "get", "us')  # a line being written
    found = rbac.requests(rbac.read_audit(log), "system:serviceaccount:sgdjob-system:")
    assert rbac.used(found) == {
        ("", "pods", "create"),
        ("sgdjob.dev", "sgdjobs/status", "patch"),
        ("coordination.k8s.io", "leases", "watch"),
        ("", "nodes", "delete"),
    }
    assert [r.permission for r in rbac.denied(found)] == [("", "nodes", "delete")]
    # Read from an offset: only what came after it.
    since = len("\n".join(lines[:5])) + 1
    assert [r.permission for r in rbac.requests(rbac.read_audit(log, since), OP)] == [("", "nodes", "delete")]
    assert rbac.audit_size(tmp_path / "none.log") == 0
