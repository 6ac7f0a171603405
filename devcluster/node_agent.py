"""A node agent (our stand-in for kubelets) that runs the pods bound to its Nodes as local processes.

It registers Nodes (capacity incl. `nvidia.com/gpu`, Ready, heartbeats by Lease every few seconds and by
status patch), watches Pods and Services of the whole cluster, and gives each pod bound to one of its
nodes a PodRunner (devcluster/pod_runner.py): a loopback IP of its own, a hosts file standing in for cluster
DNS, its volumes in a per-pod folder, and its containers as processes. `fail_node` emulates node loss.

Pod containers run inside `unshare --mount --uts` with the pod's hosts file bind-mounted over
/etc/hosts and the pod's hostname set; where that is impossible (no privileges) the agent says why in
`isolation_error` and runs pods without it (DNS names then do not resolve). Every process is in its
own process group, tagged (devcluster/proctree.py) and killed on stop(), at interpreter exit, or when the
parent dies (PR_SET_PDEATHSIG via setpriv).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from devcluster import podspec
from devcluster.kube import KubeApi, KubeError
from devcluster.pod_runner import CONTAINER_ID_SCHEME, PodRunner, RunnerConfig, now_iso
from devcluster.proctree import kill_tagged, new_agent_tag, tagged_pids

log = logging.getLogger("devcluster.node_agent")
Obj = dict[str, Any]
_HOSTS_SCRIPT = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


@dataclass(frozen=True)
class NodeSpec:
    """One Node the agent registers and runs pods for."""

    name: str
    gpus: int = 0
    cpu: str = "8"
    memory: str = "32Gi"
    pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[Obj, ...] = ()

    def capacity(self) -> dict[str, str]:
        out = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods), "ephemeral-storage": "100Gi"}
        if self.gpus:
            out["nvidia.com/gpu"] = str(self.gpus)
        return out


class NodeAgent:
    """Runs every pod scheduled onto `nodes`; start() returns once the nodes are registered and Ready."""

    def __init__(
        self,
        kubeconfig: Path,
        nodes: Sequence[NodeSpec],
        workdir: Path,
        *,
        bin_dir: Path | None = None,
        heartbeat_s: float = 5.0,
        backoff_base: float = 1.0,
        backoff_cap: float = 10.0,
        grace_cap: float = 10.0,
        extra_env: dict[str, str] | None = None,
        net_octet: int | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.workdir = workdir
        self.heartbeat_s, self.grace_cap = heartbeat_s, grace_cap
        # The venv's bin first: a container's `python`, `torchrun` or `sgdjob` is the one of this checkout.
        bin_dir = bin_dir or Path(sys.executable).parent
        self.path = f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.tag = new_agent_tag()
        # Pods get 127.<octet>.x.y (x >= 1), nodes 127.<octet>.0.n: one /16 per agent, away from
        # 127.0.0.0/24 and from the Service range 127.96.0.0/16 of devcluster/controlplane.py.
        self.octet = net_octet or random.randint(1, 95)
        self.kube = KubeApi(kubeconfig, ca_file=ca_file)
        self.api_port = self.kube.port
        self.isolation, self.isolation_error = False, ""
        self.runner_cfg = RunnerConfig(
            kube=self.kube,
            api_port=self.api_port,
            tag=self.tag,
            path=self.path,
            wrapper=self._wrapper,
            hosts_for=self._hosts_for,
            allocatable={},
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            extra_env=dict(extra_env or {}),
        )
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._runners: dict[str, PodRunner] = {}
        self._services: dict[tuple[str, str], Obj] = {}
        self._pods: dict[str, Obj] = {}  # every pod in the cluster, by uid: the DNS records' source
        self._records: list[podspec.Record] = []
        self._dead: set[str] = set()
        self._ips: set[str] = set()
        self._next_ip = 256
        self._gpus_free: dict[str, list[int]] = {n.name: list(range(n.gpus)) for n in nodes}

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._probe_isolation()
        atexit.register(self.stop)
        for node in self.nodes.values():
            self._register(node)
        for target, name in (
            (self._heartbeats, "heartbeats"),
            (self._watch_pods, "watch-pods"),
            (self._watch_services, "watch-services"),
        ):
            threading.Thread(target=target, name=f"agent-{name}", daemon=True).start()  # daemons: they end with _stop
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop every container (SIGTERM, SIGKILL after `grace`), heartbeats and watches. Idempotent."""
        self._stop.set()
        with self._lock:
            runners = list(self._runners.values())
        for runner in runners:
            runner.request_stop(min(grace, self.grace_cap), delete=False)
        for runner in runners:
            runner.join(timeout=grace + 10)
        kill_tagged(self.tag)  # last sweep: nothing this agent started may outlive it
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def leftover_pids(self) -> list[int]:
        """Processes of this agent still alive (empty after stop(); tests assert it)."""
        return tagged_pids(self.tag)

    def _probe_isolation(self) -> None:
        """Check once that a per-pod /etc/hosts and hostname work here, so a failure is named up front."""
        probe = self.workdir / "hosts-probe"
        probe.write_text("127.0.0.1 localhost\n127.1.2.3 sgdjob-probe\n")
        try:
            argv = [
                *self._namespaces(),
                "/bin/sh",
                "-c",
                _HOSTS_SCRIPT,
                "sh",
                str(probe),
                "sgdjob-probe",
                "getent",
                "hosts",
                "sgdjob-probe",
            ]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
            self.isolation = done.returncode == 0 and "127.1.2.3" in done.stdout
            self.isolation_error = (
                "" if self.isolation else f"`{' '.join(argv[:6])}` failed: {done.stderr.strip() or done.stdout.strip()}"
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            self.isolation_error = f"per-pod /etc/hosts unavailable: {err}"
        if not self.isolation:
            log.warning(
                "node agent: pods run WITHOUT their own /etc/hosts and hostname "
                "(cluster DNS names will not resolve): %s",
                self.isolation_error,
            )

    def _namespaces(self) -> list[str]:
        user = [] if os.geteuid() == 0 else ["--map-root-user"]  # a user namespace lets non-root mount
        return ["unshare", *user, "--mount", "--uts", "--propagation", "private", "--"]

    def _wrapper(self, hosts: Path, hostname: str) -> list[str]:
        # pdeathsig: if the agent's process dies without cleaning up, the kernel kills each container.
        prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        if not self.isolation:
            return prefix
        return [*prefix, *self._namespaces(), "/bin/sh", "-c", _HOSTS_SCRIPT, "sh", str(hosts), hostname]

    # ---- nodes ------------------------------------------------------------------------------------
    def node_ip(self, name: str) -> str:
        return f"127.{self.octet}.0.{list(self.nodes).index(name) + 1}"

    def _conditions(self, ready: str, reason: str, message: str) -> list[Obj]:
        ts = now_iso()
        quiet = [
            ("MemoryPressure", "KubeletHasSufficientMemory"),
            ("DiskPressure", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "KubeletHasSufficientPID"),
        ]
        conds = [
            {
                "type": t,
                "status": "False",
                "reason": r,
                "message": "",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }
            for t, r in quiet
        ]
        return [
            *conds,
            {
                "type": "Ready",
                "status": ready,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            },
        ]

    def _register(self, node: NodeSpec) -> None:
        labels = {
            "kubernetes.io/hostname": node.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **node.labels,
        }
        cap = node.capacity()
        self.runner_cfg.allocatable.update(cap)  # resourceFieldRef defaults; all nodes alike but GPUs
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node.name, "labels": labels},
            "spec": {"taints": list(node.taints)} if node.taints else {},
            "status": {
                "capacity": cap,
                "allocatable": cap,
                "conditions": self._conditions(
                    "True", "KubeletReady", "sgdjob devcluster node agent is posting ready status"
                ),
                "addresses": [
                    {"type": "InternalIP", "address": self.node_ip(node.name)},
                    {"type": "Hostname", "address": node.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {
                    **dict.fromkeys(("machineID", "systemUUID", "bootID"), ""),
                    **{
                        "kernelVersion": os.uname().release,
                        "osImage": "sgdjob devcluster node agent (processes, no containers)",
                    },
                    **{
                        "containerRuntimeVersion": f"{CONTAINER_ID_SCHEME}0",
                        "kubeletVersion": "v1.20.2",
                        "kubeProxyVersion": "v1.20.2",
                    },
                    **{"operatingSystem": "linux", "architecture": "amd64"},
                },
            },
        }
        try:
            self.kube.create("/api/v1/nodes", body)  # Node status may be set on create, so it is Ready at once
        except KubeError as err:
            if err.status != 409:
                raise
            self.kube.patch(f"/api/v1/nodes/{node.name}", {"metadata": {"labels": labels}})
            self.kube.patch(f"/api/v1/nodes/{node.name}/status", {"status": body["status"]})
        self._renew_lease(node.name)

    def _renew_lease(self, name: str) -> None:
        leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}
        try:
            self.kube.patch(f"{leases}/{name}", {"spec": spec}, kind="merge")
        except KubeError as err:
            if err.status != 404:
                raise
            self.kube.create(
                leases,
                {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": spec},
            )

    def _heartbeats(self) -> None:
        beat = 0
        while not self._stop.wait(self.heartbeat_s):
            beat += 1
            with self._lock:
                live = [n for n in self.nodes if n not in self._dead]
            for name in live:
                try:
                    self._renew_lease(name)
                    if (
                        beat % 2 == 0
                    ):  # leases are the heartbeat; status every other beat, like a kubelet's slower report
                        self.kube.patch(
                            f"/api/v1/nodes/{name}/status",
                            {
                                "status": {
                                    "conditions": self._conditions("True", "KubeletReady", "posting ready status")
                                }
                            },
                        )
                except Exception as err:  # keep beating; the API server may be restarting
                    if not self._stop.is_set():
                        log.warning("heartbeat for %s failed: %s", name, err)

    def fail_node(self, name: str, mark_unknown: bool = True) -> None:
        """Emulate losing a node: its heartbeats stop, every process of its pods is SIGKILLed, and
        nothing more is reported for them (pods stay as they were, deletions stay pending, as with a
        dead kubelet). `mark_unknown` writes Ready=Unknown at once instead of after the node
        controller's 40 s grace, so the node lifecycle controller taints it right away.
        """
        with self._lock:
            self._dead.add(name)
            victims = [r for r in self._runners.values() if r.node == name]
        for runner in victims:
            runner.request_stop(0.0, delete=False)
        for runner in victims:
            runner.join(timeout=10)
        if mark_unknown:
            conds = self._conditions("Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")
            self.kube.patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": conds}})

    def recover_node(self, name: str) -> None:
        """The node's kubelet comes back: Ready again, and its pods are run anew (fresh processes)."""
        with self._lock:
            self._dead.discard(name)
            for uid in [uid for uid, r in self._runners.items() if r.node == name]:
                self._release(self._runners.pop(uid))
        self.kube.patch(
            f"/api/v1/nodes/{name}/status",
            {"status": {"conditions": self._conditions("True", "KubeletReady", "posting ready status")}},
        )
        self._renew_lease(name)
        for pod in self.kube.get("/api/v1/pods", fieldSelector=f"spec.nodeName={name}")["items"]:
            self._on_pod("ADDED", pod)

    # ---- pods -------------------------------------------------------------------------------------
    def _on_pod(self, kind: str, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        uid, node = meta["uid"], spec.get("nodeName")
        finalize = False
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = pod
        self._refresh_hosts()
        with self._lock:
            if kind == "DELETED":
                runner = self._runners.pop(uid, None)
                if runner is not None:  # force-deleted: no object left to report to
                    runner.request_stop(0.0 if node in self._dead else self.grace_cap, delete=False)
                    self._release(runner)
                return
            if node not in self.nodes or node in self._dead or self._stop.is_set():
                return
            runner = self._runners.get(uid)
            if meta.get("deletionTimestamp"):
                grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
                if runner is not None and not runner.finished.is_set():
                    runner.request_stop(min(float(grace), self.grace_cap), delete=True)
                else:
                    finalize = True  # nothing runs for it (finished or never started)
            elif runner is None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                runner = self._new_runner(pod)
                self._runners[uid] = runner
                runner.start()
        if finalize:
            PodRunner.finalize_pod(self.kube, meta)

    def _new_runner(self, pod: Obj) -> PodRunner:
        node = pod["spec"]["nodeName"]
        want = sum(
            int(podspec.quantity(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0)))
            for c in pod["spec"]["containers"]
        )
        free = self._gpus_free[node]
        gpus, self._gpus_free[node] = free[:want], free[want:]
        meta = pod["metadata"]
        poddir = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        return PodRunner(self.runner_cfg, pod, self._alloc_ip(), self.node_ip(node), gpus, poddir)

    def _alloc_ip(self) -> str:
        while True:
            self._next_ip = self._next_ip + 1 if self._next_ip < 256 * 256 - 1 else 257
            x, y = divmod(self._next_ip, 256)
            ip = f"127.{self.octet}.{x}.{y}"
            if 0 < y < 255 and ip not in self._ips:
                self._ips.add(ip)
                return ip

    def _release(self, runner: PodRunner) -> None:
        self._ips.discard(runner.pod_ip)
        self._gpus_free[runner.node] = sorted(self._gpus_free[runner.node] + runner.gpus)

    def _hosts_for(self, pod: Obj, pod_ip: str) -> str:
        with self._lock:
            records = self._records
        return podspec.render_hosts(pod, pod_ip, records)

    def _on_service(self, kind: str, svc: Obj) -> None:
        key = (svc["metadata"]["namespace"], svc["metadata"]["name"])
        with self._lock:
            if kind == "DELETED":
                self._services.pop(key, None)
            else:
                self._services[key] = svc
        self._refresh_hosts()

    def _refresh_hosts(self) -> None:
        """Cluster DNS follows Services and pod readiness; so do the pods' hosts files (rewritten if changed)."""
        with self._lock:
            records = podspec.service_records(self._services.values(), self._pods.values())
            if records == self._records:
                return
            self._records = records
            runners = [r for r in self._runners.values() if not r.finished.is_set()]
        for runner in runners:
            runner.write_hosts()

    def runner(self, namespace: str, name: str) -> PodRunner | None:
        """The newest runner of a pod by name (pods are keyed by uid; names are reused)."""
        with self._lock:
            found = [r for r in self._runners.values() if (r.ns, r.pod_name) == (namespace, name)]
        return found[-1] if found else None

    def logs(self, namespace: str, name: str, container: str | None = None) -> str:
        """What `kubectl logs` would show (there is no kubelet API; logs are files in the pod folder)."""
        runner = self.runner(namespace, name)
        if runner is None:
            raise KeyError(f"no pod {namespace}/{name} ran on this agent")
        path = runner.log_path(container or runner.pod["spec"]["containers"][0]["name"])
        return path.read_text(errors="replace") if path.exists() else ""

    # ---- watches ------------------------------------------------------------------------------------
    def _watch(self, path: str, handle: Callable[[str, Obj], None]) -> None:
        """List then watch, resuming from the last resourceVersion; relist on expiry or any error.
        What vanished between two lists is handled as DELETED, so a missed deletion is never kept.
        """
        known: dict[str, Obj] = {}
        while not self._stop.is_set():
            try:
                listing = self.kube.get(path)
                listed = {item["metadata"]["uid"]: item for item in listing["items"]}
                for uid in known.keys() - listed.keys():
                    handle("DELETED", known.pop(uid))
                for uid, item in listed.items():
                    known[uid] = item
                    handle("ADDED", item)
                version = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    for event in self.kube.watch(path, version):
                        if self._stop.is_set():
                            return
                        if event["type"] == "ERROR":  # typically 410 Gone: the version is too old
                            raise KubeError(event["object"].get("code", 0), "WATCH", path, json.dumps(event["object"]))
                        if event["type"] != "BOOKMARK":
                            obj = event["object"]
                            known[obj["metadata"]["uid"]] = obj
                            if event["type"] == "DELETED":
                                del known[obj["metadata"]["uid"]]
                            handle(event["type"], obj)
                        version = event["object"]["metadata"]["resourceVersion"]
            except Exception as err:  # relist: 410 Gone and dropped connections alike
                if self._stop.is_set():
                    return
                log.debug("watch %s restarts: %s", path, err)
                self._stop.wait(0.5)

    def _watch_pods(self) -> None:
        self._watch("/api/v1/pods", self._on_pod)

    def _watch_services(self) -> None:
        self._watch("/api/v1/services", self._on_service)
