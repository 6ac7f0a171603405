"""A local cluster with real nodes: the control plane plus N kubelets, each with its own containerd,
network namespace, mount namespace, pod CIDR and cgroup tree (layout: devcluster/realconf.py).

    cluster = RealCluster(workdir, nodes=3).start(images)   # ~30-60 s on 2 cores; root only
    RealCluster(workdir, nodes=3, node_cpus=[0.8, 0.8, 0.27])  # slow nodes: a CPU quota each (realcpus.py)
    cluster.kubectl("get", "nodes")                         # the API through a loopback forwarder
    cluster.stop()                                          # nothing left: processes, namespaces, cgroups

Every daemon runs at nice 19 in its own session (devcluster/realdaemons.py); pids are written to
`<workdir>/state.json` as they start, so `RealCluster.load(workdir).stop()` (the `down` command) can
clean up after any process, even one that crashed halfway through `start`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from devcluster import realconf, realcpus, realfiles, realhost, realnet
from devcluster.controlplane import assets_dir, run_kubectl
from devcluster.images import Image, import_image
from devcluster.kube import KubeApi
from devcluster.realconf import Layout
from devcluster.realdaemons import DAEMON_NICE, NICE, Daemons, renice

log = logging.getLogger("devcluster.realnodes")
# One at a time, in this order: an API server whose etcd is gone hangs in its shutdown until SIGKILL,
# and the DNS feeder would log failed listings once the API server is gone.
PLANE_STOP_ORDER = (
    "kube-scheduler", "kube-controller-manager", "clusterdns", "dnsmasq", "nsproxy", "kube-apiserver", "etcd",
)  # fmt: skip


class RealCluster:
    """Control plane in the fabric namespace, `nodes` kubelet nodes, and a forwarder on the host's loopback."""

    def __init__(
        self, workdir: Path, nodes: int = 3, prefix: str = "sgdjob", node_cpus: Sequence[float] | None = None
    ) -> None:
        self.layout = Layout(Path(workdir).resolve(), nodes, prefix)
        # CPUs per node (a cgroup CPU quota, advertised as allocatable), node-0 first; None: unlimited.
        self.node_cpus = realcpus.validate(node_cpus, nodes)
        self.daemons = Daemons(self.layout.workdir, self.layout.logs, self._save)
        self.api_port = 0
        self.created: list[str] = []  # host directories made as mount points, removed by stop()
        self.timings: dict[str, float] = {}
        self._t0 = time.monotonic()

    # --- access ---
    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig for this machine's loopback (host side)."""
        return self.layout.etc / "admin.kubeconfig"

    @property
    def incluster_kubeconfig(self) -> Path:
        """The admin kubeconfig for use inside the cluster's namespaces (https://10.250.0.1:6443)."""
        return self.layout.incluster_kubeconfig

    def kube(self) -> KubeApi:
        return KubeApi(self.kubeconfig)

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run_kubectl(self.kubeconfig, *args, check=check, input_text=input_text)

    def node_names(self) -> list[str]:
        return [self.layout.node_name(i) for i in range(self.layout.nodes)]

    # --- state ---
    def state(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "kind": "real",
            "workdir": str(lay.workdir),
            "nodes": lay.nodes,
            "prefix": lay.prefix,
            "node_cpus": self.node_cpus,
            "pids": self.daemons.pids,
            "cmds": self.daemons.cmds,
            "api_port": self.api_port,
            "created": self.created,
            "kubeconfig": str(self.kubeconfig),
            "node_names": self.node_names(),
            "timings": self.timings,
        }

    def _save(self) -> None:
        path = self.layout.workdir / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, workdir: Path) -> RealCluster:
        info = json.loads((Path(workdir) / "state.json").read_text())
        cluster = cls(Path(info["workdir"]), int(info["nodes"]), str(info["prefix"]), info.get("node_cpus"))
        cluster.daemons.pids = {k: int(v) for k, v in info["pids"].items()}
        cluster.daemons.cmds = dict(info["cmds"])
        cluster.api_port = int(info["api_port"])
        cluster.created = list(info["created"])
        cluster.timings = dict(info.get("timings", {}))
        return cluster

    def _mark(self, phase: str) -> None:
        self.timings[phase] = round(time.monotonic() - self._t0, 2)
        log.info("%s after %.1f s", phase, self.timings[phase])

    # --- start ---
    def start(self, images: Sequence[Image] = (), timeout: float = 300.0, install: bool = True) -> RealCluster:
        """Bring the cluster up and import `images` into every node; returns once every node is Ready."""
        reason = realhost.unavailable()
        if reason is not None:
            raise realhost.HostNotReady(reason)
        bin_dir = assets_dir()
        if self.node_cpus:
            realcpus.hierarchy()  # no v1 cpu hierarchy: say so before anything is made
        realhost.ensure_packages(realconf.CNI_BIN, install)
        lay = self.layout
        if realnet.exists(lay.fabric_ns) and not realhost.reclaim_abandoned(lay):
            raise RuntimeError(
                f"network namespace {lay.fabric_ns} exists: a real cluster is up (python -m devcluster down)"
            )
        self._t0 = time.monotonic()
        self.api_port, made = realfiles.write_files(lay, self.kubeconfig)
        self.created += made
        self._save()
        try:
            realhost.make_cgroups([lay.node_cgroup(i) for i in range(lay.nodes)])
            for i in range(lay.nodes):
                self._limit_cpus(i)
            realnet.create(lay)
            self._mark("network")
            self._start_plane(bin_dir, timeout)
            self._start_nodes(bin_dir, timeout)
            self.import_images(images)
            self._mark("images imported")
            self.daemons.wait(self._nodes_schedulable, timeout, "every node Ready and schedulable")
            self.daemons.wait(self._default_sa, timeout, "the default ServiceAccount")
            self._mark("ready")
            self._save()
        except BaseException:
            log.exception("start failed; logs in %s", lay.logs)
            self.stop(remove_files=False)
            raise
        return self

    def _start_plane(self, bin_dir: Path, timeout: float) -> None:
        lay = self.layout
        fab = realnet.enter(lay.fabric_ns)
        self.daemons.spawn(
            "nsproxy",
            [
                # As a script (it needs only the standard library): the cwd is not the checkout.
                sys.executable, str(Path(__file__).with_name("nsproxy.py")),
                "--netns", str(realnet.ns_path(lay.fabric_ns)),
                "--listen", f"127.0.0.1:{self.api_port}", "--connect", f"{realconf.FABRIC_IP}:{realconf.API_PORT}",
            ],
            [],
        )  # fmt: skip
        self.daemons.spawn("etcd", realconf.etcd_argv(bin_dir, lay), [*fab, *NICE])
        self._start_apiserver(bin_dir, timeout)
        self._mark("api ready")
        self.daemons.spawn("dnsmasq", realconf.dnsmasq_argv(lay), [*fab, *NICE])
        self.daemons.spawn("clusterdns", realconf.clusterdns_argv(sys.executable, lay), [*fab, *NICE])
        self.daemons.spawn("kube-controller-manager", realconf.controller_manager_argv(bin_dir, lay), [*fab, *NICE])
        self.daemons.spawn("kube-scheduler", realconf.scheduler_argv(bin_dir, lay), [*fab, *NICE])

    def _start_apiserver(self, bin_dir: Path, timeout: float) -> None:
        lay = self.layout
        self.daemons.spawn(
            "kube-apiserver", realconf.apiserver_argv(bin_dir, lay), [*realnet.enter(lay.fabric_ns), *NICE]
        )
        self.daemons.wait(self._api_ready, timeout, "the API server")

    def _start_nodes(self, bin_dir: Path, timeout: float) -> None:
        lay = self.layout
        for i in range(lay.nodes):
            d = lay.node_dir(i)
            argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", realhost.holder_script(d)]
            self.daemons.spawn(f"{lay.node_name(i)}.holder", argv, realnet.enter(lay.node_ns(i)))
        for i in range(lay.nodes):
            ready = lay.node_dir(i) / "holder.ready"
            self.daemons.wait(ready.exists, 30, f"{lay.node_name(i)}'s mount namespace")
            self.daemons.spawn(f"{lay.node_name(i)}.containerd", *self._containerd_argv(i))
        for i in range(lay.nodes):
            self._start_kubelet(bin_dir, i, timeout)
        self._mark("nodes started")

    def _into_node(self, i: int) -> list[str]:
        """The prefix that runs a daemon in node i's network and mount namespaces (its holder's)."""
        holder = self.daemons.pids[f"{self.layout.node_name(i)}.holder"]
        return ["nsenter", "-t", str(holder), "-n", "-m", "--", *NICE]

    def _containerd_argv(self, i: int) -> tuple[list[str], list[str]]:
        return ["containerd", "--config", str(self.layout.node_dir(i) / "containerd.toml")], self._into_node(i)

    def _start_kubelet(self, bin_dir: Path, i: int, timeout: float) -> None:
        """kubelet and kube-proxy of node i, once its containerd answers."""
        lay = self.layout
        sock = lay.containerd_socket(i)
        self.daemons.wait(lambda: _containerd_up(sock), timeout, f"{lay.node_name(i)}'s containerd")
        cpus = self.node_cpus[i] if self.node_cpus else None
        argv = realconf.kubelet_argv(bin_dir, lay, i, realcpus.kubelet_flags(cpus, realcpus.machine_cpus()))
        self.daemons.spawn(f"{lay.node_name(i)}.kubelet", argv, self._into_node(i))
        self.daemons.spawn(
            f"{lay.node_name(i)}.kube-proxy", realconf.kube_proxy_argv(bin_dir, lay, i), self._into_node(i)
        )

    def _limit_cpus(self, i: int) -> None:
        """Node i's CPU quota on its cgroup, the parent of all its pods' (devcluster/realcpus.py)."""
        if self.node_cpus:
            realcpus.apply(realcpus.hierarchy(), self.layout.node_cgroup(i), self.node_cpus[i])

    # --- faults (the chaos suite) ---
    def _node_index(self, name: str) -> int:
        if name not in self.node_names():
            raise ValueError(f"no node {name!r} in this cluster (nodes: {', '.join(self.node_names())})")
        return self.node_names().index(name)

    def fail_node(self, name: str) -> int:
        """Lose a node as a power cut would: SIGKILL its kubelet, kube-proxy, containerd, the shims and
        every container, with no clean-up and nothing reported to the API server (the Node object stays
        as it was until the node controller's grace runs out). Only the namespace holder survives, so
        the node can come back (`recover_node`). Returns how many processes were killed. The node's cgroup
        stays, and with it its CPU quota (`node_cpus`)."""
        i = self._node_index(name)
        holder = self.daemons.pids[f"{name}.holder"]
        killed = realhost.kill_cgroup(self.layout.node_cgroup(i))  # the containers first: no one reports
        killed += self.daemons.sweep([self.layout.node_ns(i)], keep=[holder])
        for daemon in ("containerd", "kubelet", "kube-proxy"):
            self.daemons.pids.pop(f"{name}.{daemon}", None)
            if (proc := self.daemons.procs.pop(f"{name}.{daemon}", None)) is not None:
                proc.wait(timeout=10)  # reaped here: `Daemons.wait` takes an exited daemon for a crash
        self._save()
        log.warning("node %s failed: %d processes killed", name, killed)
        return killed

    def recover_node(self, name: str, timeout: float = 120.0) -> None:
        """The failed node boots again: containerd, kubelet and kube-proxy start in its namespaces as at
        `start`; returns once the node is Ready (its pods are then the kubelet's business, as after a
        reboot: containers that died are reported as such). Its cgroup is made again if something removed
        it (the kubelet refuses a missing --cgroup-root), and its CPU quota written again."""
        i = self._node_index(name)
        realhost.make_cgroups([self.layout.node_cgroup(i)])  # nothing to do when it is still there
        self._limit_cpus(i)
        self.daemons.spawn(f"{name}.containerd", *self._containerd_argv(i))
        self._start_kubelet(assets_dir(), i, timeout)
        # This node only: another may still be down (the chaos suite loses two, then returns both).
        self.daemons.wait(lambda: self._nodes_schedulable([name]), timeout, f"{name} Ready again")

    def restart_apiserver(self, down_s: float = 0.0, timeout: float = 60.0) -> None:
        """Stop the API server (SIGTERM, SIGKILL after 15 s), leave it down `down_s`, start it again with
        the same flags and etcd; returns once it answers. Nodes and clients reconnect by themselves."""
        self.daemons.terminate(["kube-apiserver"], 15)
        self.daemons.procs.pop("kube-apiserver", None)
        time.sleep(down_s)
        self._start_apiserver(assets_dir(), timeout)

    def pod_logs(self, namespace: str, prefix: str) -> dict[str, str]:
        """Every log file the nodes hold of containers of pods in `namespace` whose name starts with
        `prefix` (current and earlier containers, while the kubelet keeps them), by path."""
        found = {}
        for i in range(self.layout.nodes):
            pods = self.layout.node_dir(i) / "log" / "pods"
            for path in sorted(pods.glob(f"{namespace}_{prefix}*/*/*.log")):
                with contextlib.suppress(OSError):
                    found[str(path)] = path.read_text(errors="replace")
        return found

    def import_images(self, images: Sequence[Image]) -> dict[str, float]:
        """Import image archives into every node's containerd (skipped where the same one is there);
        two at a time, as the machine has two cores. Returns seconds per image and node."""
        jobs = [(img, i) for img in images for i in range(self.layout.nodes)]

        def one(job: tuple[Image, int]) -> tuple[str, float]:
            img, i = job
            t0 = time.monotonic()
            import_image(self.layout.containerd_socket(i), img)
            return f"{img.ref}@{self.layout.node_name(i)}", round(time.monotonic() - t0, 2)

        # containerd unpacks what ctr sends; at its nice 19 the other half of `make test` starved it
        # (CI: 4 nodes' imports past pytest's 600-s limit), so it runs at normal priority meanwhile.
        # By process group, which renices every thread (setpriority by pid would only renice one).
        groups = [self.daemons.pids[f"{self.layout.node_name(i)}.containerd"] for i in range(self.layout.nodes)]
        renice(groups, 0)
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:
                return dict(pool.map(one, jobs))
        finally:
            renice(groups, DAEMON_NICE)

    # --- readiness ---
    def _api_ready(self) -> bool:
        # The default namespace appears a moment after /readyz turns ok; the first clients need it.
        return bool(self.kube().get_or_none("/api/v1/namespaces/default"))

    def _nodes_schedulable(self, names: list[str] | None = None) -> bool:
        """`names` (default: every node) Ready and without a node.kubernetes.io/ taint."""
        ok = set()
        for node in self.kube().get("/api/v1/nodes")["items"]:
            conditions = node["status"].get("conditions", [])
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            tainted = any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints") or [])
            if ready and not tainted:
                ok.add(node["metadata"]["name"])
        return set(self.node_names() if names is None else names) <= ok

    def _default_sa(self) -> bool:
        sa = self.kube().get_or_none("/api/v1/namespaces/default/serviceaccounts/default")
        return bool(sa and sa.get("secrets"))

    # --- stop ---
    def stop(self, remove_files: bool = True) -> list[str]:
        """Stop everything; returns what could not be cleaned (empty when all is gone)."""
        lay = self.layout
        nodes = [lay.node_name(i) for i in range(lay.nodes)]
        t0 = time.monotonic()
        self.daemons.terminate([f"{n}.{d}" for n in nodes for d in ("kube-proxy", "kubelet")], 15)
        realhost.kill_cgroup(lay.cgroup_root)  # the containers
        self.daemons.terminate([f"{n}.containerd" for n in nodes], 15)
        log.info("nodes stopped after %.1f s", time.monotonic() - t0)
        for name in PLANE_STOP_ORDER:
            self.daemons.terminate([name], 15)
        log.info("control plane stopped after %.1f s", time.monotonic() - t0)
        # Whatever is left in our namespaces: containerd shims, the holders, anything stuck.
        names = [lay.fabric_ns, *(lay.node_ns(i) for i in range(lay.nodes))]
        self.daemons.sweep(names)
        log.info("namespaces swept after %.1f s", time.monotonic() - t0)
        realhost.kill_cgroup(lay.cgroup_root)
        for proc in self.daemons.procs.values():
            if proc.poll() is None:
                proc.wait(timeout=10)
        problems = [f"process {pid} still in the cluster's namespaces" for pid in realnet.pids_in(names)]
        realnet.delete(lay)
        problems += realhost.remove_cgroups(lay.cgroup_root)
        log.info("namespaces and cgroups removed after %.1f s", time.monotonic() - t0)
        for path in self.created:
            try:
                Path(path).rmdir()
            except OSError as err:
                problems.append(f"{path}: {err.strerror}")
        problems += [f"still mounted on the host: {m}" for m in realhost.mounts_under(lay.workdir)]
        if remove_files and not problems:
            shutil.rmtree(lay.workdir, ignore_errors=True)  # the containerd roots: every image, unpacked
            log.info("files removed after %.1f s", time.monotonic() - t0)
        return problems


def _containerd_up(sock: Path) -> bool:
    if not sock.exists():
        return False
    return subprocess.run(["ctr", "--address", str(sock), "version"], capture_output=True, check=False).returncode == 0
