"""What the real-node cluster needs from the host: Debian packages, cgroup trees, and each node's mount
namespace (the "holder" process that keeps it); whether this host can run one at all (`unavailable`),
and the removal of what a killed run left (`reclaim_abandoned`).

Why a mount namespace per node: three kubelets on one machine would otherwise share paths that a kubelet
believes it owns. Every minute a kubelet deletes the /var/log/pods folders of pods it does not know,
i.e. the other nodes' logs; and it sets machine-wide kernel tunables (vm.overcommit_memory=1,
kernel.panic=10, kernel.panic_on_oops=1) at start. In its node's namespace /var/log is the node's own
folder, /run is a private tmpfs (containerd's shim sockets, runc state, the pods' network namespace
files, the iptables lock), /var/lib/cni (CNI's result cache) is per node, and so is
/var/lib/kubelet/device-plugins, whose path the kubelet does not take from --root-dir: each kubelet
empties it and binds kubelet.sock there at start, so three sharing it race (one of them exits with
"bind: address already in use", seen on a fresh machine). The tunables' /proc/sys files are masked by
files that already hold the values the kubelet wants, so it writes nothing to the host. The namespace
disappears, with every mount made in it, when its last process exits: nothing is left mounted on the
host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from devcluster import realconf, realnet
from devcluster.controlplane import AssetsMissing, assets_dir
from devcluster.proctree import alive
from devcluster.realconf import Layout

log = logging.getLogger("devcluster.realnodes")

CGROUP_V1 = Path("/sys/fs/cgroup")
APT_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "conntrack", "dnsmasq-base")
COMMANDS = (
    "containerd", "containerd-shim-runc-v2", "ctr", "runc", "iptables", "conntrack", "nsenter", "unshare", "dnsmasq",
)  # fmt: skip
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
NODE_BINARIES = ("kubelet", "kube-proxy", "kube-controller-manager", "kube-scheduler")
# The kubelet's device-plugin socket folder (fixed in v1.20), parent first: mount points per node.
DEVICE_PLUGINS_PATHS = (Path("/var/lib/kubelet"), Path("/var/lib/kubelet/device-plugins"))
# The kubelet's desired kernel tunables (pkg/kubelet/cm/container_manager_linux.go, v1.20).
KUBELET_TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}


class HostNotReady(RuntimeError):
    """The machine cannot run real nodes (not root, no packages, no binaries)."""


def unavailable() -> str | None:
    """Why real nodes cannot run on this host (root, the node binaries), or None."""
    if os.geteuid() != 0:
        return "real nodes need root (network namespaces, containerd, cgroups)"
    try:
        bin_dir = assets_dir()
    except AssetsMissing as err:
        return str(err)
    missing = [b for b in NODE_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        return f"KUBEBUILDER_ASSETS={bin_dir} lacks {', '.join(missing)} (../shared/k8s/install.sh provides them)"
    return None


def missing_host_tools(cni_bin: Path) -> list[str]:
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    return missing + [str(cni_bin / p) for p in CNI_PLUGINS if not (cni_bin / p).is_file()]


def ensure_packages(cni_bin: Path, install: bool = True) -> None:
    """apt-get install what is missing (containerd, runc, CNI plugins, iptables, conntrack, dnsmasq)."""
    if not missing_host_tools(cni_bin):
        return
    if not install:
        raise HostNotReady(
            f"missing {', '.join(missing_host_tools(cni_bin))} (apt-get install {' '.join(APT_PACKAGES)})"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["nice", "-n", "19", "apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]
    log.info("installing %s", " ".join(APT_PACKAGES))
    if subprocess.run(cmd, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=False)
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise HostNotReady(f"apt-get install failed: {result.stderr.strip()[-500:]}")
    if missing_host_tools(cni_bin):
        raise HostNotReady(f"still missing after apt-get: {missing_host_tools(cni_bin)}")


# --- cgroups (v1, cgroupfs driver: no systemd on this machine) ---


def _hierarchies() -> list[Path]:
    if not CGROUP_V1.is_dir():
        return []
    return [h for h in sorted(CGROUP_V1.iterdir()) if (h / "cgroup.procs").exists() and h.name != "unified"]


def make_cgroups(paths: list[str]) -> None:
    """Create each cgroup (e.g. /sgdjob-devcluster/node-0) in every v1 hierarchy: the kubelet refuses a
    --cgroup-root that does not exist. A new cpuset is empty (no process may join it) until it has
    its parent's cpus and mems."""
    for h in _hierarchies():
        for path in paths:
            node = h
            for part in Path(path).relative_to("/").parts:
                parent, node = node, node / part
                node.mkdir(exist_ok=True)
                if h.name == "cpuset":
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        if not (node / f).read_text().strip():
                            (node / f).write_text((parent / f).read_text())


def cgroup_pids(root: str) -> set[int]:
    """Every process in the tree under `root`, in any hierarchy."""
    pids: set[int] = set()
    for h in [*_hierarchies(), CGROUP_V1 / "unified"]:
        for folder in _tree(h / root.lstrip("/")):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
    return pids


def _tree(top: Path) -> list[Path]:
    """Every cgroup under `top` (itself included), deepest first. The kubelet removes a container's
    cgroup while we walk (a node being failed, a pod being deleted): os.walk skips what vanished,
    where Path.rglob raises FileNotFoundError."""
    return [Path(folder) for folder, _dirs, _files in os.walk(top, topdown=False)]


def kill_cgroup(root: str, timeout: float = 15.0) -> int:
    """SIGKILL every process in the tree (the containers) until none is left; returns how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    # Zombies stay listed until their new parent reaps them; they are already dead.
    while (pids := {p for p in cgroup_pids(root) if alive(p)}) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.1)
    return len(killed)


def remove_cgroups(root: str) -> list[str]:
    """rmdir the tree bottom-up in every hierarchy; returns what could not be removed."""
    left = []
    for h in [*_hierarchies(), CGROUP_V1 / "unified"]:
        top = h / root.lstrip("/")
        if not top.is_dir():
            continue
        for d in _tree(top)[:-1]:  # deepest first; `top` itself below
            with contextlib.suppress(OSError):
                d.rmdir()
        try:
            top.rmdir()
        except OSError as err:
            left.append(f"{top}: {err.strerror}")
    return left


# --- a node's mount namespace ---


def holder_script(node_dir: Path) -> str:
    """Shell run by `unshare --mount` inside the node's network namespace: the mounts above, then a
    `sleep` that keeps the namespace for the node's daemons (they join it with nsenter -t PID -m)."""
    q = shlex.quote
    lines = [
        "set -e",
        "mount -t tmpfs -o mode=0755,size=64m devcluster-run /run",
        f"mount --bind {q(str(node_dir / 'log'))} /var/log",
        f"mount --bind {q(str(node_dir / 'cni-cache'))} /var/lib/cni",
        f"mount --bind {q(str(node_dir / 'device-plugins'))} {DEVICE_PLUGINS_PATHS[-1]}",
    ]
    for key in KUBELET_TUNABLES:
        lines.append(f"mount --bind {q(str(node_dir / 'sysctl' / key.replace('/', '.')))} /proc/sys/{key}")
    lines += [f": > {q(str(node_dir / 'holder.ready'))}", "exec sleep infinity"]
    return "\n".join(lines)


def prepare_node_dir(node_dir: Path) -> None:
    for sub in ("log", "cni-cache", "device-plugins", "sysctl", "kubelet", "volume-plugins", "cni", "cni-ipam", "runc"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    for key, value in KUBELET_TUNABLES.items():
        (node_dir / "sysctl" / key.replace("/", ".")).write_text(value + "\n")
    (node_dir / "holder.ready").unlink(missing_ok=True)


def ensure_mountpoint(path: Path) -> bool:
    """Make a directory the node namespaces mount over; True when it did not exist before (remove later)."""
    if path.is_dir():
        return False
    path.mkdir(parents=True)
    return True


def mounts_under(prefix: Path) -> list[str]:
    """Mount points under `prefix` in this (the host's) mount namespace; there should be none."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target == str(prefix) or target.startswith(f"{prefix}/"):
            out.append(target)
    return out


def reclaim_abandoned(lay: Layout) -> bool:
    """Remove the namespaces and cgroups of a cluster with this layout whose every process is gone (a
    run killed before its stop: the namespaces outlive their processes); True when removed. A cluster
    with any process left in its namespaces or cgroups is someone's running cluster: left alone."""
    every = Layout(lay.workdir, realconf.MAX_NODES, lay.prefix)  # it may have had more nodes than this one
    names = [n for n in [every.fabric_ns, *(every.node_ns(i) for i in range(every.nodes))] if realnet.exists(n)]
    if realnet.pids_in(names) or any(alive(p) for p in cgroup_pids(lay.cgroup_root)):
        return False
    removed = realnet.delete(every)
    left = remove_cgroups(lay.cgroup_root)
    log.warning("removed an abandoned cluster's namespaces %s (no process left in them)", ", ".join(removed))
    return not left and not realnet.exists(lay.fabric_ns)
