"""The pure pod -> process rules of the node agent (no control plane needed)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from devcluster import podspec

Obj = dict[str, Any]


def pod(**spec: Any) -> Obj:
    return {
        "metadata": {"name": "w-0", "namespace": "ns", "uid": "u1", "labels": {"app": "w"}},
        "spec": {"nodeName": "node-1", "containers": [], **spec},
    }


def test_quantities_and_expansion() -> None:
    assert (
        podspec.quantity("500m") == 0.5
        and podspec.quantity("2Gi") == 2 * 2**30
        and podspec.quantity("1e3") == 1000
        and podspec.quantity(3) == 3
    )
    with pytest.raises(ValueError):
        podspec.quantity("2Gx")
    assert podspec.expand("$(A)-$(B)-$$(A)", {"A": "x"}) == "x-$(B)-$(A)"


def test_rewrite_replaces_whole_paths_once() -> None:
    table = {"/data": Path("/tmp/pod/volumes/data"), "/tmp": Path("/tmp/pod/volumes/tmp")}
    assert (
        podspec.rewrite("--dir=/data/ckpt /database /mnt/data /data", table)
        == "--dir=/tmp/pod/volumes/data/ckpt /database /mnt/data /tmp/pod/volumes/data"
    )
    # A replacement that starts with another mountPath (/tmp) is not rewritten again.
    assert podspec.rewrite("/tmp/x", table) == "/tmp/pod/volumes/tmp/x"


def test_env_order_refs_and_missing_objects() -> None:
    objects = {
        ("configmap", "cfg"): {"data": {"mode": "sync"}},
        ("secret", "sec"): {"data": {"t": base64.b64encode(b"tok").decode()}},
    }
    container = {
        "name": "main",
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "C_"}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "T", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "t"}}},
            {"name": "GPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.nvidia.com/gpu", "divisor": "0"}}},
            {"name": "X", "value": "$(C_mode)/$(IP)"},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k", "optional": True}}},
        ],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    env = podspec.container_env(
        pod(), container, lambda kind, name: objects.get((kind, name)), "127.5.1.1", "127.5.0.2", {}, {}
    )
    assert env == {"C_mode": "sync", "IP": "127.5.1.1", "APP": "w", "T": "tok", "GPU": "1", "X": "sync/127.5.1.1"}
    with pytest.raises(podspec.Missing):
        podspec.container_env(
            pod(), {"name": "m", "envFrom": [{"secretRef": {"name": "nope"}}]}, lambda kind, name: None, "", "", {}, {}
        )


def test_volumes_items_modes_and_subpath(tmp_path: Path) -> None:
    spec = pod(
        volumes=[
            {"name": "cfg", "configMap": {"name": "cfg", "items": [{"key": "a", "path": "sub/a.txt", "mode": 0o600}]}},
            {"name": "e", "emptyDir": {}},
        ]
    )
    vols = podspec.write_volumes(
        spec, tmp_path, lambda kind, name: {"data": {"a": "A", "b": "B"}}, lambda s: "", ("", ""), {}
    )
    assert (vols["cfg"] / "sub" / "a.txt").read_text() == "A" and not (vols["cfg"] / "b").exists()
    assert (vols["cfg"] / "sub" / "a.txt").stat().st_mode & 0o777 == 0o600
    table = podspec.mounts({"volumeMounts": [{"name": "e", "mountPath": "/work/", "subPath": "w1"}]}, vols)
    assert table == {"/work": vols["e"] / "w1"} and (vols["e"] / "w1").is_dir()
    with pytest.raises(podspec.Unsupported):
        podspec.write_volumes(
            pod(volumes=[{"name": "p", "persistentVolumeClaim": {"claimName": "c"}}]),
            tmp_path,
            lambda k, n: None,
            lambda s: "",
            ("", ""),
            {},
        )


def test_service_records_follow_the_endpoints_controller_rules() -> None:
    ready = [{"type": "Ready", "status": "True"}]

    def member(name: str, ip: str, conditions: list[Obj], **extra: Any) -> Obj:
        p = pod(hostname=name, subdomain="w")
        p["metadata"] = {**p["metadata"], "name": name, **extra}
        p["status"] = {"podIP": ip, "phase": "Running", "conditions": conditions}
        return p

    pods = [
        member("w-0", "127.5.1.1", ready),
        member("w-1", "127.5.1.2", []),
        member("w-2", "127.5.1.3", ready, deletionTimestamp="x"),
    ]
    headless = {"metadata": {"namespace": "ns", "name": "w"}, "spec": {"clusterIP": "None", "selector": {"app": "w"}}}
    other = {
        "metadata": {"namespace": "ns", "name": "api"},
        "spec": {"selector": {"app": "w"}, "publishNotReadyAddresses": True},
    }
    records = podspec.service_records([headless, other], pods)
    assert records == [("ns", "api", "127.5.1.1", ""), ("ns", "api", "127.5.1.2", ""), ("ns", "w", "127.5.1.1", "w-0")]
    hosts = podspec.render_hosts(pods[1], "127.5.1.2", [*records, ("ns", "w", "10.0.0.9", "evil")])
    assert "127.5.1.2\tw-1.w.ns.svc.cluster.local w-1\n" in hosts
    assert (
        "127.5.1.1\tw-0.w.ns.svc.cluster.local w-0.w.ns.svc w-0.w.ns w-0.w w.ns.svc.cluster.local w.ns.svc w.ns w\n"
        in hosts
    )
    assert "10.0.0.9" not in hosts  # never a non-loopback address
