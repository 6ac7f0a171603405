"""Network namespaces of the real-node cluster (layout in devcluster/realconf.py) and the processes in them.

Only `ip`, `nsenter` and `sysctl` run here, always against a namespace this tool created: the host
gets no interface, route, iptables rule or sysctl change. Each node's daemons are started through
`nsenter --net=` rather than `ip netns exec`, because `ip netns exec` also remounts /sys, which a
kubelet must see as the host's (cgroups, devices).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

from devcluster.proctree import alive
from devcluster.realconf import FABRIC_BRIDGE, FABRIC_IP, SERVICE_CIDR, Layout

NETNS_DIR = Path("/run/netns")


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")


def ns_path(name: str) -> Path:
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return ns_path(name).exists()


def enter(name: str) -> list[str]:
    """argv prefix that runs a command inside network namespace `name` (exec, no extra process)."""
    return ["nsenter", f"--net={ns_path(name)}", "--"]


def _sysctl(ns: str, *settings: str) -> None:
    # Network sysctls apply to the writer's namespace, so this changes `ns` only.
    _run(*enter(ns), "sysctl", "-qw", *settings)


def create(layout: Layout) -> None:
    """The fabric namespace with its bridge, then each node's namespace wired to it by a veth pair."""
    fab = layout.fabric_ns
    _run("ip", "netns", "add", fab)
    _run("ip", "-n", fab, "link", "set", "lo", "up")
    _run("ip", "-n", fab, "link", "add", FABRIC_BRIDGE, "type", "bridge")
    _run("ip", "-n", fab, "addr", "add", f"{FABRIC_IP}/24", "dev", FABRIC_BRIDGE)
    _run("ip", "-n", fab, "link", "set", FABRIC_BRIDGE, "up")
    _sysctl(fab, "net.ipv4.ip_forward=1")
    for i in range(layout.nodes):
        ns = layout.node_ns(i)
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # Made in the fabric, the node end moved into the node's namespace as eth0.
        _run("ip", "-n", fab, "link", "add", layout.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", fab, "link", "set", layout.veth(i), "master", FABRIC_BRIDGE, "up")
        _run("ip", "-n", ns, "addr", "add", f"{layout.node_ip(i)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        # Anything not on the fabric goes to the fabric, which has no uplink: unreachable at once.
        # This route also lets the node itself open connections to ClusterIPs (DNAT in OUTPUT
        # happens after the route lookup, which needs some route).
        _run("ip", "-n", ns, "route", "add", "default", "via", FABRIC_IP)
        # The fabric routes pod traffic to the node that owns the pod CIDR (API server -> webhooks).
        _run("ip", "-n", fab, "route", "add", layout.pod_cidr(i), "via", layout.node_ip(i))
        for j in range(layout.nodes):
            if j != i:  # pod to pod across nodes: straight to the other node over the fabric bridge
                _run("ip", "-n", ns, "route", "add", layout.pod_cidr(j), "via", layout.node_ip(j))
        _sysctl(
            ns,
            "net.ipv4.ip_forward=1",
            # kube-proxy's rules must see bridged pod traffic (a pod reaching a Service whose
            # endpoint is on the same bridge).
            "net.bridge.bridge-nf-call-iptables=1",
            "net.ipv4.conf.all.route_localnet=1",
        )
    # ClusterIPs from the fabric (the API server calling a webhook through its Service): through the
    # nodes, whose kube-proxy rules translate them; kube-proxy masquerades traffic from outside the
    # cluster CIDR, so the reply returns through the same node. One flow sticks to one node.
    hops = [a for i in range(layout.nodes) for a in ("nexthop", "via", layout.node_ip(i))]
    _run("ip", "-n", fab, "route", "add", SERVICE_CIDR, *hops)


def delete(layout: Layout) -> list[str]:
    """Remove the cluster's namespaces (their veths and bridges go with them); returns what was removed."""
    removed = []
    for name in [*(layout.node_ns(i) for i in range(layout.nodes)), layout.fabric_ns]:
        if exists(name):
            _run("ip", "netns", "del", name)
            removed.append(name)
    return removed


def ns_inode(path: Path) -> str | None:
    """The namespace a /proc/<pid>/ns/* link or a /run/netns file stands for, e.g. 'net:[4026532301]'."""
    try:
        return f"net:[{os.stat(path).st_ino}]"
    except OSError:
        return None


def pids_in(names: Iterable[str]) -> list[int]:
    """Live processes whose network namespace is one of the named ones (this process excluded).

    The namespaces are pinned by their /run/netns files while they exist, so their inode numbers
    cannot be reused: a process in one of them belongs to this cluster.
    """
    wanted = {ino for ino in (ns_inode(ns_path(n)) for n in names) if ino}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if ns_inode(entry / "ns" / "net") in wanted and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def kill_all_in(names: Iterable[str], keep: Iterable[int] = ()) -> list[int]:
    """SIGKILL every process in the named namespaces but those in `keep`; returns the pids."""
    spared = set(keep)
    pids = [p for p in pids_in(list(names)) if p not in spared]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
