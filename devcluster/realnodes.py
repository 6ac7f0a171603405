"""A local cluster with real nodes: the control plane plus N kubelets, each with its own containerd,
network namespace, mount namespace, pod CIDR and cgroup tree (layout: devcluster/realconf.py).

    cluster = RealCluster(workdir, nodes=3).start(images)   # ~30-60 s on 2 cores; root only
    RealCluster(workdir, nodes=3, node_cpus=[0.8, 0.8, 0.27])  # slow nodes: a CPU quota each (realcpus.py)
    cluster.kubectl("get", "nodes")                         # the API through a loopback forwarder
    cluster.stop()                                          # nothing left: processes, namespaces, cgroups

Every daemon runs at nice 19 in its own session; pids are written to `<workdir>/state.json` as they
start, so `RealCluster.load(workdir).stop()` (the `down` command) can clean up after any process,
even one that crashed halfway through `start`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from devcluster import realconf, realcpus, realhost, realnet
from devcluster.controlplane import AssetsMissing, assets_dir, free_port, kubeconfig_text, run_kubectl
from devcluster.images import Image, import_image
from devcluster.kube import KubeApi, KubeError
from devcluster.proctree import alive
from devcluster.realconf import Layout

log = logging.getLogger("devcluster.realnodes")
DAEMON_NICE = 19
NICE = ["nice", "-n", str(DAEMON_NICE)]
# One at a time, in this order: an API server whose etcd is gone hangs in its shutdown until SIGKILL,
# and the DNS feeder would log failed listings once the API server is gone.
PLANE_STOP_ORDER = (
    "kube-scheduler", "kube-controller-manager", "clusterdns", "dnsmasq", "nsproxy", "kube-apiserver", "etcd",
)  # fmt: skip
NODE_BINARIES = ("kubelet", "kube-proxy", "kube-controller-manager", "kube-scheduler")


def reclaim_abandoned(lay: Layout) -> bool:
    """Remove the namespaces and cgroups of a cluster with this layout whose every process is gone (a
    run killed before its stop: the namespaces outlive their processes); True when removed. A cluster
    with any process left in its namespaces or cgroups is someone's running cluster: left alone."""
    every = Layout(lay.workdir, realconf.MAX_NODES, lay.prefix)  # it may have had more nodes than this one
    names = [n for n in [every.fabric_ns, *(every.node_ns(i) for i in range(every.nodes))] if realnet.exists(n)]
    if realnet.pids_in(names) or any(alive(p) for p in realhost.cgroup_pids(lay.cgroup_root)):
        return False
    removed = realnet.delete(every)
    left = realhost.remove_cgroups(lay.cgroup_root)
    log.warning("removed an abandoned cluster's namespaces %s (no process left in them)", ", ".join(removed))
    return not left and not realnet.exists(lay.fabric_ns)


class RealCluster:
    """Control plane in the fabric namespace, `nodes` kubelet nodes, and a forwarder on the host's loopback."""

    def __init__(
        self, workdir: Path, nodes: int = 3, prefix: str = "sgdjob", node_cpus: Sequence[float] | None = None
    ) -> None:
        self.layout = Layout(Path(workdir).resolve(), nodes, prefix)
        # CPUs per node (a cgroup CPU quota, advertised as allocatable), node-0 first; None: unlimited.
        self.node_cpus = realcpus.validate(node_cpus, nodes)
        self.pids: dict[str, int] = {}
        self.cmds: dict[str, str] = {}  # name -> the binary, to tell our pid from a reused one
        self.api_port = 0
        self.created: list[str] = []  # host directories made as mount points, removed by stop()
        self.timings: dict[str, float] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
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
            "pids": self.pids,
            "cmds": self.cmds,
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
        cluster.pids = {k: int(v) for k, v in info["pids"].items()}
        cluster.cmds = dict(info["cmds"])
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
        reason = unavailable()
        if reason is not None:
            raise realhost.HostNotReady(reason)
        bin_dir = assets_dir()
        if self.node_cpus:
            realcpus.hierarchy()  # no v1 cpu hierarchy: say so before anything is made
        realhost.ensure_packages(realconf.CNI_BIN, install)
        lay = self.layout
        if realnet.exists(lay.fabric_ns) and not reclaim_abandoned(lay):
            raise RuntimeError(
                f"network namespace {lay.fabric_ns} exists: a real cluster is up (python -m devcluster down)"
            )
        self._t0 = time.monotonic()
        self._write_files()
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
            self._wait(self._nodes_schedulable, timeout, "every node Ready and schedulable")
            self._wait(self._default_sa, timeout, "the default ServiceAccount")
            self._mark("ready")
            self._save()
        except BaseException:
            log.exception("start failed; logs in %s", lay.logs)
            self.stop(remove_files=False)
            raise
        return self

    def _write_files(self) -> None:
        lay = self.layout
        for d in (lay.etc, lay.logs, lay.plane_dir / "certs", lay.dns_dir):
            d.mkdir(parents=True, exist_ok=True)
        etc = lay.etc
        subprocess.run(["openssl", "genrsa", "-out", str(etc / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(etc / "sa.key"), "-pubout", "-out", str(etc / "sa.pub")],
            check=True,
            capture_output=True,
        )
        tokens = {name: secrets.token_hex(24) for name, _, _ in lay.identities()}
        _private(etc / "tokens.csv", realconf.tokens_csv(tokens, lay))
        self.api_port = free_port()
        for name, user, _ in lay.identities():
            _private(etc / f"{name}.kubeconfig", kubeconfig_text(lay.api_server, user, tokens[name]))
        _private(self.kubeconfig, kubeconfig_text(f"https://127.0.0.1:{self.api_port}", "admin", tokens["admin"]))
        _private(self.incluster_kubeconfig, kubeconfig_text(lay.api_server, "admin", tokens["admin"]))
        # The node's resolver, for dnsPolicy Default pods: a query to their own loopback fails at
        # once instead of waiting for a server that is not there.
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        made = [p for p in (Path("/var/lib/cni"), *realhost.DEVICE_PLUGINS_PATHS) if realhost.ensure_mountpoint(p)]
        self.created += [str(p) for p in reversed(made)]  # a child before its parent: removed with rmdir
        for i in range(lay.nodes):
            d = lay.node_dir(i)
            realhost.prepare_node_dir(d)
            (d / "cni" / "10-devcluster.conflist").write_text(realconf.cni_conflist(lay, i))
            (d / "containerd.toml").write_text(realconf.containerd_toml(lay, i))

    def _spawn(self, name: str, argv: list[str], prefix: list[str]) -> int:
        out = open(self.layout.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(
                [*prefix, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.layout.workdir,
                start_new_session=True,
            )
        finally:
            out.close()
        # nsenter and nice exec the next program: this pid is the daemon's own.
        self._procs[name], self.pids[name], self.cmds[name] = proc, proc.pid, Path(argv[0]).name
        self._save()
        return proc.pid

    def _start_plane(self, bin_dir: Path, timeout: float) -> None:
        lay = self.layout
        fab = realnet.enter(lay.fabric_ns)
        self._spawn(
            "nsproxy",
            [
                # As a script (it needs only the standard library): the cwd is not the checkout.
                sys.executable, str(Path(__file__).with_name("nsproxy.py")),
                "--netns", str(realnet.ns_path(lay.fabric_ns)),
                "--listen", f"127.0.0.1:{self.api_port}", "--connect", f"{realconf.FABRIC_IP}:{realconf.API_PORT}",
            ],
            [],
        )  # fmt: skip
        self._spawn("etcd", realconf.etcd_argv(bin_dir, lay), [*fab, *NICE])
        self._start_apiserver(bin_dir, timeout)
        self._mark("api ready")
        self._spawn("dnsmasq", realconf.dnsmasq_argv(lay), [*fab, *NICE])
        self._spawn("clusterdns", realconf.clusterdns_argv(sys.executable, lay), [*fab, *NICE])
        self._spawn("kube-controller-manager", realconf.controller_manager_argv(bin_dir, lay), [*fab, *NICE])
        self._spawn("kube-scheduler", realconf.scheduler_argv(bin_dir, lay), [*fab, *NICE])

    def _start_apiserver(self, bin_dir: Path, timeout: float) -> None:
        lay = self.layout
        self._spawn("kube-apiserver", realconf.apiserver_argv(bin_dir, lay), [*realnet.enter(lay.fabric_ns), *NICE])
        self._wait(self._api_ready, timeout, "the API server")

    def _start_nodes(self, bin_dir: Path, timeout: float) -> None:
        lay = self.layout
        for i in range(lay.nodes):
            d = lay.node_dir(i)
            argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", realhost.holder_script(d)]
            self._spawn(f"{lay.node_name(i)}.holder", argv, realnet.enter(lay.node_ns(i)))
        for i in range(lay.nodes):
            ready = lay.node_dir(i) / "holder.ready"
            self._wait(ready.exists, 30, f"{lay.node_name(i)}'s mount namespace")
            self._spawn(f"{lay.node_name(i)}.containerd", *self._containerd_argv(i))
        for i in range(lay.nodes):
            self._start_kubelet(bin_dir, i, timeout)
        self._mark("nodes started")

    def _into_node(self, i: int) -> list[str]:
        """The prefix that runs a daemon in node i's network and mount namespaces (its holder's)."""
        holder = self.pids[f"{self.layout.node_name(i)}.holder"]
        return ["nsenter", "-t", str(holder), "-n", "-m", "--", *NICE]

    def _containerd_argv(self, i: int) -> tuple[list[str], list[str]]:
        return ["containerd", "--config", str(self.layout.node_dir(i) / "containerd.toml")], self._into_node(i)

    def _start_kubelet(self, bin_dir: Path, i: int, timeout: float) -> None:
        """kubelet and kube-proxy of node i, once its containerd answers."""
        lay = self.layout
        sock = lay.containerd_socket(i)
        self._wait(lambda: _containerd_up(sock), timeout, f"{lay.node_name(i)}'s containerd")
        cpus = self.node_cpus[i] if self.node_cpus else None
        argv = realconf.kubelet_argv(bin_dir, lay, i, realcpus.kubelet_flags(cpus, realcpus.machine_cpus()))
        self._spawn(f"{lay.node_name(i)}.kubelet", argv, self._into_node(i))
        self._spawn(f"{lay.node_name(i)}.kube-proxy", realconf.kube_proxy_argv(bin_dir, lay, i), self._into_node(i))

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
        holder = self.pids[f"{name}.holder"]
        killed = realhost.kill_cgroup(self.layout.node_cgroup(i))  # the containers first: no one reports
        killed += self._sweep([self.layout.node_ns(i)], keep=[holder])
        for daemon in ("containerd", "kubelet", "kube-proxy"):
            self.pids.pop(f"{name}.{daemon}", None)
            if (proc := self._procs.pop(f"{name}.{daemon}", None)) is not None:
                proc.wait(timeout=10)  # reaped here: `_wait` takes an exited daemon for a crash
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
        self._spawn(f"{name}.containerd", *self._containerd_argv(i))
        self._start_kubelet(assets_dir(), i, timeout)
        self._wait(self._nodes_schedulable, timeout, f"{name} Ready again")

    def restart_apiserver(self, down_s: float = 0.0, timeout: float = 60.0) -> None:
        """Stop the API server (SIGTERM, SIGKILL after 15 s), leave it down `down_s`, start it again with
        the same flags and etcd; returns once it answers. Nodes and clients reconnect by themselves."""
        self._terminate(["kube-apiserver"], 15)
        self._procs.pop("kube-apiserver", None)
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
        groups = [self.pids[f"{self.layout.node_name(i)}.containerd"] for i in range(self.layout.nodes)]
        _renice(groups, 0)
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:
                return dict(pool.map(one, jobs))
        finally:
            _renice(groups, DAEMON_NICE)

    # --- readiness ---
    def _wait(self, check: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    log_tail = (self.layout.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode} waiting for {what}:\n{log_tail}")
            try:
                if check():
                    return
            except (KubeError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {self.layout.logs}")

    def _api_ready(self) -> bool:
        # The default namespace appears a moment after /readyz turns ok; the first clients need it.
        return bool(self.kube().get_or_none("/api/v1/namespaces/default"))

    def _nodes_schedulable(self) -> bool:
        ok = set()
        for node in self.kube().get("/api/v1/nodes")["items"]:
            conditions = node["status"].get("conditions", [])
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            tainted = any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints") or [])
            if ready and not tainted:
                ok.add(node["metadata"]["name"])
        return set(self.node_names()) <= ok

    def _default_sa(self) -> bool:
        sa = self.kube().get_or_none("/api/v1/namespaces/default/serviceaccounts/default")
        return bool(sa and sa.get("secrets"))

    # --- stop ---
    def stop(self, remove_files: bool = True) -> list[str]:
        """Stop everything; returns what could not be cleaned (empty when all is gone)."""
        lay = self.layout
        nodes = [lay.node_name(i) for i in range(lay.nodes)]
        t0 = time.monotonic()
        self._terminate([f"{n}.{d}" for n in nodes for d in ("kube-proxy", "kubelet")], 15)
        realhost.kill_cgroup(lay.cgroup_root)  # the containers
        self._terminate([f"{n}.containerd" for n in nodes], 15)
        log.info("nodes stopped after %.1f s", time.monotonic() - t0)
        for name in PLANE_STOP_ORDER:
            self._terminate([name], 15)
        log.info("control plane stopped after %.1f s", time.monotonic() - t0)
        # Whatever is left in our namespaces: containerd shims, the holders, anything stuck.
        names = [lay.fabric_ns, *(lay.node_ns(i) for i in range(lay.nodes))]
        self._sweep(names)
        log.info("namespaces swept after %.1f s", time.monotonic() - t0)
        realhost.kill_cgroup(lay.cgroup_root)
        for proc in self._procs.values():
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

    def _terminate(self, names: list[str], grace: float) -> None:
        """SIGTERM to each (still ours) process, then SIGKILL whatever is alive after `grace` seconds."""
        pids = [self.pids[n] for n in names if n in self.pids and self._ours(n)]
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.1)
        for pid in pids:
            if alive(pid):
                _signal(pid, signal.SIGKILL)
        self._reap()

    def _sweep(self, namespaces: list[str], keep: Sequence[int] = (), timeout: float = 15) -> int:
        """SIGKILL whatever runs in the network namespaces (but `keep`) until nothing is left or
        `timeout` passes; returns how many processes were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while (pids := realnet.kill_all_in(namespaces, keep)) and time.monotonic() < deadline:
            killed.update(pids)
            self._reap()
            time.sleep(0.1)
        return len(killed)

    def _ours(self, name: str) -> bool:
        pid = self.pids[name]
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return self.cmds[name] in cmdline

    def _reap(self) -> None:
        for proc in self._procs.values():
            proc.poll()


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


def _containerd_up(sock: Path) -> bool:
    if not sock.exists():
        return False
    return subprocess.run(["ctr", "--address", str(sock), "version"], capture_output=True, check=False).returncode == 0


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _private(path: Path, text: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(text)


def _renice(process_groups: Sequence[int], nice: int) -> None:
    for pgid in process_groups:
        with contextlib.suppress(ProcessLookupError):  # a node failed on purpose (chaos) has none
            os.setpriority(os.PRIO_PGRP, pgid, nice)
