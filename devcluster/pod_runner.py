"""One pod's containers as local processes, reporting status the way a kubelet does.

A PodRunner is a thread: it writes the pod's volumes, runs init containers in order and then all
containers, polls them (0.2 s), restarts them per restartPolicy with exponential backoff, and patches
pods/status whenever what it would report changes. A container is ready while its process is alive
and its readinessProbe (tcpSocket/httpGet, see devcluster/probes.py) passes. See devcluster/README.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from devcluster import podspec, probes
from devcluster.kube import KubeApi, KubeError, pod_path
from devcluster.proctree import TAG_KEY, kill_tagged

log = logging.getLogger("devcluster.node_agent")
# A container's ID: this scheme and its main process's host pid (a kubelet's are `containerd://<id>`).
CONTAINER_ID_SCHEME = "devcluster://"
TERMINATION_LOG = "/dev/termination-log"  # the default terminationMessagePath
TERMINATION_MESSAGE_BYTES = 4096  # what the kubelet keeps of a termination message
Obj = dict[str, Any]


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class RunnerConfig:
    """What every runner shares with its agent."""

    kube: KubeApi
    api_port: int
    tag: str  # the agent's tag prefix, "<agent>/"
    path: str  # PATH for containers: the venv's bin first, so `python`/`torchrun`/`sgdjob` are ours
    wrapper: Callable[[Path, str], list[str]]  # (hosts file, hostname) -> argv prefix (namespaces, pdeathsig)
    hosts_for: Callable[[Obj, str], str]  # (pod, pod ip) -> /etc/hosts text
    allocatable: dict[str, str]
    backoff_base: float = 1.0
    backoff_cap: float = 10.0
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Ctr:
    """One container's runtime state, in the terms of a v1.ContainerStatus."""

    spec: Obj
    init: bool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    backoff_n: int = 0
    started_at: str | None = None
    started_mono: float = 0.0
    cid: str = ""
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    next_start: float = 0.0
    done: bool = False
    exit_code: int | None = None
    ready: bool = False
    next_probe: float = 0.0

    @property
    def name(self) -> str:
        return str(self.spec["name"])


class PodRunner(threading.Thread):
    def __init__(self, cfg: RunnerConfig, pod: Obj, pod_ip: str, host_ip: str, gpus: list[int], poddir: Path) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.cfg, self.pod, self.pod_ip, self.host_ip, self.gpus, self.dir = cfg, pod, pod_ip, host_ip, gpus, poddir
        self.ns, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.node = pod["spec"]["nodeName"]
        self.policy = pod["spec"].get("restartPolicy", "Always")
        self.tag = f"{cfg.tag}{self.uid}/"
        self.ctrs = [Ctr(c, True) for c in pod["spec"].get("initContainers") or []] + [
            Ctr(c, False) for c in pod["spec"]["containers"]
        ]
        self.volumes: dict[str, Path] = {}
        self.phase = "Pending"
        self.finished = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stop_req: tuple[float, bool] | None = None  # (grace seconds, delete the pod object afterwards)
        self._sent: Obj | None = None
        self._transitions: dict[str, tuple[str, str]] = {}
        self._hosts_text = ""
        self._start_time = now_iso()
        for sub in ("volumes", "logs", "rootfs", "home", "tmp"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)

    # ---- control from the agent's threads -------------------------------------------------------
    def request_stop(self, grace: float, delete: bool) -> None:
        """Kill the containers (SIGTERM, SIGKILL after `grace`); with `delete`, finalize the pod object."""
        with self._lock:
            if self._stop_req is None or grace < self._stop_req[0]:
                self._stop_req = (grace, delete or bool(self._stop_req and self._stop_req[1]))
        self._wake.set()

    def write_hosts(self) -> None:
        """(Re)write the pod's hosts file in place, so its bind mount over /etc/hosts sees DNS changes."""
        text = self.cfg.hosts_for(self.pod, self.pod_ip)
        with self._lock:
            if text != self._hosts_text:
                podspec.write_in_place(self.dir / "hosts", text)
                self._hosts_text = text

    def log_path(self, container: str) -> Path:
        return self.dir / "logs" / f"{container}.log"

    # ---- the thread -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self._prepare():
                self._loop()
        except Exception:
            log.exception("pod %s/%s: runner failed", self.ns, self.pod_name)
        finally:
            grace, delete = self._stop_req or (0.0, False)
            self._terminate(grace)
            if delete:
                self.finalize()
            self.finished.set()

    def finalize(self) -> None:
        self.finalize_pod(self.cfg.kube, self.pod["metadata"])

    @staticmethod
    def finalize_pod(kube: KubeApi, meta: Obj) -> None:
        """Delete the pod object with grace 0 (what a kubelet does once its containers are gone)."""
        opts = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        with contextlib.suppress(KubeError):  # gone already, or a new pod of that name (uid precondition)
            kube.delete(pod_path(meta["namespace"], meta["name"]), opts)

    def _prepare(self) -> bool:
        """Write hosts and volumes, retrying while referenced objects are missing (kubelet behaviour)."""
        self.write_hosts()
        self._publish()
        while self._stop_req is None:
            try:
                self.volumes = podspec.write_volumes(
                    self.pod,
                    self.dir / "volumes",
                    self._lookup,
                    self._token,
                    (self.pod_ip, self.host_ip),
                    self.cfg.allocatable,
                )
                return True
            except (podspec.Missing, podspec.Unsupported, KubeError) as err:
                self._event("FailedMount", f"MountVolume failed: {err}", "Warning")
                for c in self.ctrs:
                    c.state = {"waiting": {"reason": "ContainerCreating", "message": f"volume: {err}"}}
                self._publish()
                self._wake.wait(2.0)
                self._wake.clear()
        return False

    def _loop(self) -> None:
        while self._stop_req is None:
            now = time.monotonic()
            for c in self._active():
                if c.proc is not None and (rc := c.proc.poll()) is not None:
                    self._exited(c, rc)
                if c.proc is None and not c.done and now >= c.next_start:
                    self._start(c)
                probe = c.spec.get("readinessProbe")
                if c.proc is not None and probe and now >= c.next_probe:
                    c.ready = probes.check(probe, c.spec, self.pod_ip)
                    c.next_probe = now + min(
                        float(probe.get("periodSeconds", 10)), 1.0
                    )  # period capped: tests wait less
            self.phase = self._phase()
            self._publish()
            if self.phase in ("Succeeded", "Failed"):
                return
            self._wake.wait(0.2)
            self._wake.clear()

    def _active(self) -> list[Ctr]:
        """The init container now due, or all app containers once every init container succeeded."""
        for c in self.ctrs:
            if c.init and not (c.done and c.exit_code == 0):
                return [c]
        return [c for c in self.ctrs if not c.init]

    # ---- containers -------------------------------------------------------------------------------
    def _start(self, c: Ctr) -> None:
        hostname, _ = podspec.pod_hostname(self.pod)
        base = {
            "PATH": self.cfg.path,
            "HOME": str(self.dir / "home"),
            "TMPDIR": str(self.dir / "tmp"),
            "HOSTNAME": hostname,
            "LANG": "C.UTF-8",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.cfg.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.cfg.api_port),
            "KUBERNETES_PORT": f"tcp://127.0.0.1:{self.cfg.api_port}",
            **self.cfg.extra_env,
        }
        if self.gpus and int(
            podspec.quantity(((c.spec.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
        ):
            base["NVIDIA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))  # what the device plugin injects
        try:
            table = podspec.mounts(c.spec, self.volumes)
            # The kubelet mounts a fresh file at terminationMessagePath in every container start; here
            # the path is rewritten (env, argv) to a file of the pod's own.
            termination = self.termination_file(c.name)
            termination.write_bytes(b"")
            table.setdefault(c.spec.get("terminationMessagePath") or TERMINATION_LOG, termination)
            user = podspec.container_env(
                self.pod, c.spec, self._lookup, self.pod_ip, self.host_ip, self.cfg.allocatable, base
            )
            env = {**base, **{k: podspec.rewrite(v, table) for k, v in user.items()}, TAG_KEY: f"{self.tag}{c.name}/"}
            argv = podspec.resolve_argv(c.spec, env, table, env["PATH"])
            cwd = podspec.working_dir(c.spec, table, self.dir / "rootfs")
        except (podspec.Missing, KubeError) as err:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}
            c.next_start = time.monotonic() + 1.0
            return
        except Exception as err:  # anything else is this pod's fault (unsupported, not found, bad value): report it
            self._event("Failed", f"Error: {err}", "Warning")
            c.started_at, c.cid = now_iso(), ""
            self._exited(c, 128, reason="StartError", message=str(err))
            return
        if c.started_at is not None:
            c.restarts += 1
        with open(self.log_path(c.name), "ab") as out:
            c.proc = subprocess.Popen(
                [*self.cfg.wrapper(self.dir / "hosts", hostname), *argv],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, like a container's PID 1
            )
        c.started_at, c.started_mono, c.cid = now_iso(), time.monotonic(), f"{CONTAINER_ID_SCHEME}{c.proc.pid}"
        c.state = {"running": {"startedAt": c.started_at}}
        probe = c.spec.get("readinessProbe")
        c.ready, c.next_probe = not probe, c.started_mono + float((probe or {}).get("initialDelaySeconds", 0))
        self._event("Started", f"Started container {c.name} (pid {c.proc.pid})")

    def termination_file(self, container: str) -> Path:
        return self.dir / f"termination-{container}"

    def _termination_message(self, c: Ctr, code: int) -> str:
        """What the kubelet reports as the terminated container's message: the file the process wrote
        (at most 4 KiB), else with FallbackToLogsOnError and a failure the log's tail."""
        try:
            with open(self.termination_file(c.name), "rb") as f:
                text = f.read(TERMINATION_MESSAGE_BYTES).decode(errors="replace")
        except OSError:
            text = ""
        if not text and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                lines = self.log_path(c.name).read_bytes().decode(errors="replace").splitlines()[-80:]
            except OSError:
                lines = []
            text = "\n".join(lines)[-2048:]
        return text

    def _exited(self, c: Ctr, rc: int, reason: str = "", message: str = "") -> None:
        code = rc if rc >= 0 else 128 - rc
        message = message or self._termination_message(c, code)
        # A container's PID 1 exiting tears down its PID namespace: nothing it started survives it.
        kill_tagged(f"{self.tag}{c.name}/")
        term: Obj = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": c.started_at,
            "finishedAt": now_iso(),
        }
        if c.cid:
            term["containerID"] = c.cid
        if rc < 0:
            term["signal"] = -rc
        if message:
            term["message"] = message
        c.proc, c.exit_code, c.ready = None, code, False
        restart = code != 0 if (c.init or self.policy == "OnFailure") else self.policy == "Always"
        if c.init and self.policy == "Never":
            restart = False
        if not restart:
            c.done, c.state = True, {"terminated": term}
            return
        if time.monotonic() - c.started_mono > 4 * self.cfg.backoff_cap:
            c.backoff_n = 0  # ran long enough: the kubelet forgets earlier crashes
        delay = min(self.cfg.backoff_base * 2**c.backoff_n, self.cfg.backoff_cap)
        c.backoff_n += 1
        c.last_state, c.next_start = {"terminated": term}, time.monotonic() + delay
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.pod_name}",
            }
        }
        self._event("BackOff", f"Back-off {delay:g}s restarting failed container {c.name} (exit {code})", "Warning")

    def _terminate(self, grace: float) -> None:
        """SIGTERM each container's main process, SIGKILL everything of this pod after `grace`."""
        live = {c.name: c.proc for c in self.ctrs if c.proc is not None and c.proc.poll() is None}
        if live:
            self._event("Killing", f"Stopping containers {', '.join(live)} (grace {grace:g}s)")
        for proc in live.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)  # the main process only, as a container runtime does
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(proc.poll() is None for proc in live.values()):
            time.sleep(0.05)
        kill_tagged(self.tag)
        for c in self.ctrs:
            if c.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)

    # ---- status -------------------------------------------------------------------------------------
    def _phase(self) -> str:
        inits = [c for c in self.ctrs if c.init]
        if any(c.done and c.exit_code != 0 for c in inits):
            return "Failed"
        if any(not (c.done and c.exit_code == 0) for c in inits):
            return "Pending"
        apps = [c for c in self.ctrs if not c.init]
        if any(c.started_at is None for c in apps):
            return "Pending"
        if all(c.done for c in apps):
            return "Failed" if any(c.exit_code for c in apps) else "Succeeded"
        return "Running"

    def _condition(self, kind: str, ok: bool, reason: str) -> Obj:
        status = "True" if ok else "False"
        prev = self._transitions.get(kind)
        if prev is None or prev[0] != status:
            self._transitions[kind] = prev = (status, now_iso())
        # reason None deletes a stale one: conditions are strategic-merged by type.
        return {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": prev[1],
            "reason": None if ok else reason,
        }

    def _container_status(self, c: Ctr) -> Obj:
        image = c.spec.get("image", "")
        out: Obj = {
            "name": c.name,
            "image": image,
            "imageID": "",
            "ready": c.ready and "running" in c.state,
            "restartCount": c.restarts,
        }
        out.update(state=c.state, lastState=c.last_state, started="running" in c.state)
        if c.cid:
            out["containerID"] = c.cid
        return out

    def _publish(self) -> None:
        apps = [c for c in self.ctrs if not c.init]
        ready = all(c.ready and "running" in c.state for c in apps)
        done_reason = "PodCompleted" if self.phase in ("Succeeded", "Failed") else "ContainersNotReady"
        inits = [c for c in self.ctrs if c.init]
        status: Obj = {
            "phase": self.phase,
            "hostIP": self.host_ip,
            "podIP": self.pod_ip,
            "podIPs": [{"$patch": "replace"}, {"ip": self.pod_ip}],  # replace, not merge: a recovered pod's new IP
            "startTime": self._start_time,
            "conditions": [
                self._condition("PodScheduled", True, ""),
                self._condition(
                    "Initialized", all(c.done and c.exit_code == 0 for c in inits), "ContainersNotInitialized"
                ),
                self._condition("ContainersReady", ready, done_reason),
                self._condition("Ready", ready, done_reason),
            ],
            "containerStatuses": [self._container_status(c) for c in apps],
        }
        if inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in inits]
        if status == self._sent:
            return
        try:
            # The uid in the patch is a precondition: a new pod of the same name is never touched.
            self.cfg.kube.patch(
                pod_path(self.ns, self.pod_name) + "/status", {"metadata": {"uid": self.uid}, "status": status}
            )
            self._sent = status
        except KubeError as err:
            if err.status in (404, 409):
                self.request_stop(0.0, delete=False)  # the pod object is gone: nothing left to report to
            else:
                log.warning("pod %s/%s: status patch failed: %s", self.ns, self.pod_name, err)

    # ---- API helpers ------------------------------------------------------------------------------
    def _lookup(self, kind: str, name: str) -> Obj | None:
        plural = "configmaps" if kind == "configmap" else "secrets"
        return self.cfg.kube.get_or_none(f"/api/v1/namespaces/{self.ns}/{plural}/{name}")

    def _token(self, source: Obj) -> str:
        """A serviceAccountToken projection: a TokenRequest bound to this pod."""
        spec: Obj = {
            "audiences": [source["audience"]] if source.get("audience") else [],
            "expirationSeconds": source.get("expirationSeconds", 3600),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.pod_name, "uid": self.uid},
        }
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        return str(
            self.cfg.kube.create(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)["status"]["token"]
        )

    def _event(self, reason: str, message: str, kind: str = "Normal") -> None:
        """A kubelet-style Event on the pod, for `kubectl describe pod`; never fails the runner."""
        ts = now_iso()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.pod_name}.{uuid.uuid4().hex[:12]}", "namespace": self.ns},
            "involvedObject": {
                "kind": "Pod",
                "apiVersion": "v1",
                "name": self.pod_name,
                "namespace": self.ns,
                "uid": self.uid,
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": self.node},
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }
        try:
            self.cfg.kube.create(f"/api/v1/namespaces/{self.ns}/events", event)
        except KubeError as err:
            log.debug("event %s for %s/%s not recorded: %s", reason, self.ns, self.pod_name, err)
