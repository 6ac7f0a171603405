"""Faults of one real node short of a power cut (RealCluster.fail_node), for the chaos suite: the
kubelet stopped while its containers run on, and the node's network cut while everything on it runs.

Functions of a RealCluster (devcluster/realnodes.py), whose daemons and namespaces they act on.
"""

from __future__ import annotations

import logging
import subprocess
from typing import TYPE_CHECKING

from devcluster import realconf, realcpus
from devcluster.controlplane import assets_dir

if TYPE_CHECKING:
    from devcluster.realnodes import RealCluster

log = logging.getLogger("devcluster.realnodes")


def stop_kubelet(cluster: RealCluster, name: str) -> None:
    """The node's kubelet stops (SIGTERM, as `systemctl stop kubelet` sends; SIGKILL after 10 s):
    containerd, kube-proxy and every container run on and stay reachable, but nothing reports to
    the API server any more, so the node controller marks the node NotReady after its grace."""
    cluster._node_index(name)
    cluster.daemons.terminate([f"{name}.kubelet"], 10)
    cluster.daemons.procs.pop(f"{name}.kubelet", None)  # stopped on purpose: `wait` takes an exit for a crash
    cluster.daemons.pids.pop(f"{name}.kubelet", None)
    cluster._save()
    log.warning("node %s: kubelet stopped, its containers left running", name)


def start_kubelet(cluster: RealCluster, name: str, timeout: float = 120.0) -> None:
    """The stopped kubelet starts again with the same flags; returns once every node is Ready. It
    finds its pods' containers still running and takes them over (or kills those whose pods were
    deleted meanwhile)."""
    i = cluster._node_index(name)
    cpus = cluster.node_cpus[i] if cluster.node_cpus else None
    flags = realcpus.kubelet_flags(cpus, realcpus.machine_cpus())
    cluster.daemons.spawn(
        f"{name}.kubelet", realconf.kubelet_argv(assets_dir(), cluster.layout, i, flags), cluster._into_node(i)
    )
    cluster.daemons.wait(cluster._nodes_schedulable, timeout, f"{name} Ready again")


def cut_network(cluster: RealCluster, name: str) -> None:
    """The node's cable is pulled: its link on the fabric goes down, so every packet between the node
    (its daemons and pods) and the rest of the cluster, the control plane included, is dropped.
    Everything on the node runs on and its pods still reach each other."""
    i = cluster._node_index(name)
    _link(cluster.layout.fabric_ns, cluster.layout.veth(i), "down")
    log.warning("node %s: network cut", name)


def restore_network(cluster: RealCluster, name: str) -> None:
    i = cluster._node_index(name)
    _link(cluster.layout.fabric_ns, cluster.layout.veth(i), "up")
    log.warning("node %s: network restored", name)


def _link(namespace: str, device: str, state: str) -> None:
    subprocess.run(["ip", "-n", namespace, "link", "set", device, state], check=True, capture_output=True)


def mount_full_volume(cluster: RealCluster, path: str) -> None:
    """A volume with no room left at `path` on every node: a small tmpfs mounted over it in each node's
    mount namespace (so pods whose hostPath is `path` see it; the host does not), writable by any uid,
    then filled to its last page. Each node has its own, so it suits single-node use (one worker)."""
    fill = (
        f"mount -t tmpfs -o size=64k,mode=0777 sgdjob-full {path} && "
        f"(dd if=/dev/zero of={path}/filler bs=4096 2>/dev/null; true)"
    )
    for name in cluster.node_names():
        holder = cluster.daemons.pids[f"{name}.holder"]
        subprocess.run(["nsenter", "-t", str(holder), "-m", "--", "sh", "-c", fill], check=True, capture_output=True)
    log.warning("a full volume at %s on every node", path)


def unmount_volume(cluster: RealCluster, path: str) -> None:
    for name in cluster.node_names():
        holder = cluster.daemons.pids.get(f"{name}.holder")
        if holder is not None:
            subprocess.run(["nsenter", "-t", str(holder), "-m", "--", "umount", "-l", path], check=False)
