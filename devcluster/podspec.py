"""Pure translation of a Pod into what the node agent runs: env, files, argv, working dir, /etc/hosts.

No API calls here: objects a pod refers to (ConfigMaps, Secrets, service-account tokens) come in
through callables, so each rule can be checked on its own and the runner owns all server I/O.
Pods are the API's JSON (camelCase dicts), exactly what `kubectl get -o json` shows.

Paths: the agent never touches the host's real mount paths. Every volume lives in a per-pod folder,
and each container's mountPaths are rewritten to those folders wherever they appear in its command,
args, env values and workingDir (see `rewrite`). Paths inside files or compiled into libraries are not
rewritten; devcluster/README.md says what that means for pods.
"""

from __future__ import annotations

import base64
import ipaddress
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
# (kind, name) -> the object's JSON or None; kind is "configmap" or "secret", namespace bound by the caller.
Lookup = Callable[[str, str], Obj | None]
# serviceAccountToken projection source -> a token string (TokenRequest API).
TokenFn = Callable[[Obj], str]

CLUSTER_DOMAIN = "cluster.local"
SUPPORTED_VOLUMES = ("emptyDir", "configMap", "secret", "downwardAPI", "projected", "hostPath")


class Missing(Exception):
    """A referenced ConfigMap, Secret or key is absent; the kubelet waits and retries in this case."""


class Unsupported(Exception):
    """Something a real kubelet runs but this agent cannot emulate (named in the message)."""


_SUFFIX: dict[str, float] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIX.update({"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18})


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2Gi", "1e3") as a float."""
    m = re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([A-Za-z]*)", str(value).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, unknown ones kept, `$$` escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


def pod_hostname(pod: Obj) -> tuple[str, str]:
    """(hostname, fqdn) as the kubelet sets them: spec.hostname or the pod name; FQDN only with a subdomain."""
    spec, meta = pod["spec"], pod["metadata"]
    host = (spec.get("hostname") or meta["name"])[:63].rstrip("-.")
    sub = spec.get("subdomain")
    return host, (f"{host}.{sub}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}" if sub else host)


def field_value(pod: Obj, path: str, pod_ip: str, host_ip: str) -> str:
    """The downward API's fieldRef values."""
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
    }
    if path in simple:
        return str(simple[path] or "")
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    raise Unsupported(f"fieldRef {path!r}")


def resource_value(container: Obj, ref: Obj, allocatable: dict[str, str]) -> str:
    """resourceFieldRef: the container's limit/request (limits default to the node's allocatable)."""
    kind, _, name = ref["resource"].partition(".")
    res = container.get("resources") or {}
    value = (res.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (res.get("limits") or {}).get(name, "0")
    if value is None:
        value = allocatable.get(name, "0")
    divisor = quantity(ref.get("divisor") or "1") or 1.0  # the API server defaults an unset divisor to "0"
    return str(math.ceil(quantity(value) / divisor))


def object_data(kind: str, obj: Obj) -> dict[str, bytes]:
    """A ConfigMap's or Secret's keys as bytes (Secret data and binaryData are base64 on the wire)."""
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def _key(lookup: Lookup, kind: str, ref: Obj) -> str | None:
    obj = lookup(kind, ref["name"])
    data = object_data(kind, obj) if obj is not None else {}
    if ref["key"] in data:
        return data[ref["key"]].decode(errors="replace")
    if ref.get("optional"):
        return None
    raise Missing(f"{kind} {ref['name']!r} key {ref['key']!r}" if obj is not None else f"{kind} {ref['name']!r}")


def container_env(
    pod: Obj,
    container: Obj,
    lookup: Lookup,
    pod_ip: str,
    host_ip: str,
    allocatable: dict[str, str],
    base: dict[str, str],
) -> dict[str, str]:
    """envFrom, then env (later wins, `$(VAR)` sees earlier values), over the agent's `base`."""
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        for field, kind in (("configMapRef", "configmap"), ("secretRef", "secret")):
            ref = src.get(field)
            if not ref:
                continue
            obj = lookup(kind, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise Missing(f"{kind} {ref['name']!r}")
            for key, raw in object_data(kind, obj).items():
                env[src.get("prefix", "") + key] = raw.decode(errors="replace")
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        value: str | None
        if not source:
            value = expand(var.get("value", ""), {**base, **env})
        elif "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            value = resource_value(container, source["resourceFieldRef"], allocatable)
        elif "configMapKeyRef" in source:
            value = _key(lookup, "configmap", source["configMapKeyRef"])
        elif "secretKeyRef" in source:
            value = _key(lookup, "secret", source["secretKeyRef"])
        else:
            raise Unsupported(f"env {name}: valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def _items(data: dict[str, bytes], spec: Obj, what: str) -> dict[str, tuple[bytes, int | None]]:
    """Keys of a configMap/secret source to relative file paths (all keys, or just `items`)."""
    if not spec.get("items"):
        return {k: (v, None) for k, v in data.items()}
    out: dict[str, tuple[bytes, int | None]] = {}
    for item in spec["items"]:
        if item["key"] in data:
            out[item["path"]] = (data[item["key"]], item.get("mode"))
        elif not spec.get("optional"):
            raise Missing(f"{what} key {item['key']!r}")
    return out


def _source_files(
    source: Obj, pod: Obj, lookup: Lookup, token: TokenFn, ips: tuple[str, str], allocatable: dict[str, str]
) -> dict[str, tuple[bytes, int | None]]:
    """The files of one volume source (a configMap, secret, downwardAPI or projected source)."""
    for field, kind, name_key in (("configMap", "configmap", "name"), ("secret", "secret", "secretName")):
        if field in source:
            spec = source[field]
            name = spec.get(name_key) or spec.get("name")
            obj = lookup(kind, name)
            if obj is None:
                if spec.get("optional"):
                    return {}
                raise Missing(f"{kind} {name!r}")
            return _items(object_data(kind, obj), spec, f"{kind} {name!r}")
    if "downwardAPI" in source:
        out: dict[str, tuple[bytes, int | None]] = {}
        for item in source["downwardAPI"].get("items") or []:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"], *ips)
            else:
                ref = item["resourceFieldRef"]
                ctr = next(
                    c
                    for c in pod["spec"]["containers"]
                    if c["name"] == ref.get("containerName", pod["spec"]["containers"][0]["name"])
                )
                value = resource_value(ctr, ref, allocatable)
            out[item["path"]] = (value.encode(), item.get("mode"))
        return out
    if "serviceAccountToken" in source:
        spec = source["serviceAccountToken"]
        return {spec["path"]: (token(spec).encode(), None)}
    raise Unsupported(f"volume source {sorted(source)}")


def write_volumes(
    pod: Obj, root: Path, lookup: Lookup, token: TokenFn, ips: tuple[str, str], allocatable: dict[str, str]
) -> dict[str, Path]:
    """Materialize the pod's volumes under `root/<volume>`; returns volume name -> folder.

    Written once at pod start, like a kubelet's first sync; later ConfigMap/Secret edits are not
    propagated (the kubelet's periodic remount is not emulated). hostPath maps to the real path.
    """
    out: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        kind = next((k for k in SUPPORTED_VOLUMES if k in vol), None)
        if kind is None:
            raise Unsupported(f"volume {name!r}: only {', '.join(SUPPORTED_VOLUMES)} are emulated")
        if kind == "hostPath":
            out[name] = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                out[name].mkdir(parents=True, exist_ok=True)
            continue
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        files: dict[str, tuple[bytes, int | None]] = {}
        if kind == "projected":
            for source in vol["projected"].get("sources") or []:
                files.update(_source_files(source, pod, lookup, token, ips, allocatable))
        elif kind != "emptyDir":
            files = _source_files({kind: vol[kind]}, pod, lookup, token, ips, allocatable)
        default_mode = (vol.get(kind) or {}).get("defaultMode", 0o644)
        for rel, (data, mode) in files.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode if mode is not None else default_mode)
        out[name] = folder
    return out


def mounts(container: Obj, volumes: dict[str, Path]) -> dict[str, Path]:
    """The container's mountPath -> host folder (subPath resolved inside the volume)."""
    out: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        path = mount["mountPath"].rstrip("/")
        if not path:
            raise Unsupported("a volume mounted at / (paths are rewritten, there is no container root)")
        src = volumes[mount["name"]]
        if mount.get("subPath"):
            src = src / mount["subPath"]
            if not src.exists():
                src.mkdir(parents=True)
        out[path] = src
    return out


def rewrite(text: str, table: dict[str, Path]) -> str:
    """Replace each mountPath where it stands as a whole path (`/data`, `/data/x`, `--dir=/data`; not
    `/database` or `/mnt/data`) by its host folder, in one pass so a replacement is never rewritten again.
    """
    if not table:
        return text
    alternatives = "|".join(re.escape(p) for p in sorted(table, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.\-/])({alternatives})(?![\w.\-])")
    return pattern.sub(lambda m: str(table[m.group(1)]), text)


def resolve_argv(container: Obj, env: dict[str, str], table: dict[str, Path], path: str) -> list[str]:
    """command + args after `$(VAR)` expansion and path rewriting; argv[0] looked up on `path`.

    Images are never run: a container without `command` cannot be emulated (its entrypoint is unknown).
    """
    if not container.get("command"):
        raise Unsupported(f"container {container['name']!r} has no command (image entrypoints are not run here)")
    argv = [rewrite(expand(a, env), table) for a in [*container["command"], *(container.get("args") or [])]]
    if "/" not in argv[0]:
        found = shutil.which(argv[0], path=path)
        if found is None:
            raise FileNotFoundError(f"executable {argv[0]!r} not found on PATH={path}")
        argv[0] = found
    return argv


def working_dir(container: Obj, table: dict[str, Path], rootfs: Path) -> Path:
    """workingDir rewritten like a path; one that does not exist on the host is made under `rootfs`."""
    wd = container.get("workingDir")
    if not wd:
        return rootfs
    path = Path(rewrite(wd, table))
    if not path.is_dir():
        path = rootfs / wd.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
    return path


def dns_names(name: str, namespace: str, own_namespace: str) -> list[str]:
    """The names cluster DNS answers for `name` in `namespace`, including the resolv.conf search forms."""
    names = [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    return [*names, name] if namespace == own_namespace else names


Record = tuple[str, str, str, str]  # (namespace, service, pod ip, hostname or "")


def service_records(services: Iterable[Obj], pods: Iterable[Obj]) -> list[Record]:
    """What the endpoints controller would publish, computed here from Services and Pods.

    The API server refuses Endpoints with loopback addresses ("may not be in the loopback range"), so
    the real controller cannot record our 127.x pod IPs; this applies its rules instead: pods matched
    by the selector, with an IP, not terminating or finished, Ready (or any, with
    publishNotReadyAddresses); a hostname when the pod's subdomain names the Service.
    """
    by_ns: dict[str, list[Obj]] = {}
    for pod in pods:
        by_ns.setdefault(pod["metadata"]["namespace"], []).append(pod)
    out: list[Record] = []
    for svc in services:
        ns, name, spec = svc["metadata"]["namespace"], svc["metadata"]["name"], svc.get("spec") or {}
        selector = spec.get("selector")
        if not selector:
            continue  # Endpoints of selector-less Services are written by their owners, not derived
        for pod in by_ns.get(ns, []):
            labels, status, pspec = pod["metadata"].get("labels") or {}, pod.get("status") or {}, pod.get("spec") or {}
            if any(labels.get(k) != v for k, v in selector.items()) or not status.get("podIP"):
                continue
            if pod["metadata"].get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
                continue
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            if ready or spec.get("publishNotReadyAddresses"):
                host = pspec.get("hostname", "") if pspec.get("subdomain") == name else ""
                out.append((ns, name, status["podIP"], host))
    return sorted(out)


def render_hosts(pod: Obj, pod_ip: str, records: Iterable[Record]) -> str:
    """The pod's /etc/hosts: the kubelet's own lines plus what cluster DNS would answer.

    `<svc>.<ns>.svc...` resolves to every ready pod of the Service (for ClusterIP Services too: there
    is no kube-proxy, so clients get pod IPs and must use the target port) and
    `<hostname>.<svc>.<ns>.svc...` to that pod (headless Service + subdomain), as with CoreDNS.
    Only loopback addresses are written, so no pod is ever pointed at the node's real address.
    """
    ns = pod["metadata"]["namespace"]
    host, fqdn = pod_hostname(pod)
    lines = [
        "# Kubernetes-managed hosts file (sgdjob devcluster node agent; also stands in for cluster DNS).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod_ip}\t{fqdn} {host}" if fqdn != host else f"{pod_ip}\t{host}",
        "127.0.0.1\t" + " ".join(dns_names("kubernetes", "default", ns)),
    ]
    for rec_ns, svc, ip, hostname in records:
        if not ipaddress.ip_address(ip).is_loopback:
            continue
        names = dns_names(svc, rec_ns, ns)
        if hostname:
            names = dns_names(f"{hostname}.{svc}", rec_ns, ns) + names
        lines.append(f"{ip}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a file keeping its inode: a bind mount of it (the pod's /etc/hosts) sees the new text."""
    if not path.exists():
        path.write_text(text)
        return
    with open(path, "r+") as handle:
        handle.write(text)
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())
