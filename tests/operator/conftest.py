"""The operator tier: a real kube-apiserver (session fixture), the operator as a subprocess
(`sgdjob operator`), and the test acting as the kubelet (binding pods, patching their status)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config

from devcluster.controlplane import ControlPlane, free_port

T = TypeVar("T")
GROUP, VERSION, PLURAL = "sgdjob.dev", "v1alpha1", "sgdjobs"
TRAINER_IMAGE = "example.org/sgdjob-trainer:test"


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25) -> T:
    """Poll until `fn` returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (AssertionError, client.ApiException) as err:
            last = err
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@dataclass
class Operator:
    """`sgdjob operator` in a subprocess against the test cluster; restartable."""

    plane: ControlPlane
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = field(default_factory=free_port)
    liveness_port: int = field(default_factory=free_port)
    args: list[str] = field(default_factory=list)  # more `sgdjob operator` options
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> Operator:
        env = {**os.environ, "SGDJOB_TRAINER_IMAGE": TRAINER_IMAGE, "PYTHONUNBUFFERED": "1", **self.env}
        argv = [
            str(Path(sys.executable).parent / "sgdjob"),
            "operator",
            "--kubeconfig",
            str(self.plane.kubeconfig),
            "--resync",
            "3",
            "--verbose",
        ]
        argv += [
            "--metrics-port",
            str(self.metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            *self.args,
        ]
        out = open(self.log, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        """As a crash or a node loss would: no clean-up handlers run."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def passes(self) -> int:
        """Reconciliation passes this process has finished, over every job it watches. A test that
        checks something does NOT happen waits for the operator's next pass rather than a fixed time:
        a pass is when it could happen, and a slower operator then makes the test slower, not vacuous.
        A pass that raised is not counted; another job's pass is, so keep only the job under test alive."""
        try:
            text = self.metrics()
        except urllib.error.URLError as err:
            if not isinstance(err.reason, ConnectionRefusedError):
                raise
            # kopf's startup handler serves the metrics before any job handler runs: no pass yet.
            return 0
        found = re.search(r"^sgdjob_operator_reconcile_seconds_count (\S+)$", text, re.MULTILINE)
        assert found, "no sgdjob_operator_reconcile_seconds_count in the operator's metrics"
        return int(float(found.group(1)))

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


@pytest.fixture(scope="module")
def operator(k8s_crd: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(k8s_crd, tmp_path_factory.mktemp("operator") / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")


@dataclass
class Cluster:
    """Clients for one test's namespace, and the kubelet's part the tests play."""

    plane: ControlPlane
    ns: str
    core: client.CoreV1Api
    custom: client.CustomObjectsApi

    def apply(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        doc = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SGDJob",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": spec,
        }
        self.plane.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
        return doc

    def job(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        return obj

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.job(name).get("status") or {})

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def pods(self, name: str, role: str = "worker") -> dict[str, Any]:
        items = self.core.list_namespaced_pod(
            self.ns, label_selector=f"sgdjob.dev/job-name={name},sgdjob.dev/role={role}"
        ).items
        return {p.metadata.name: p for p in items}

    def events(self, name: str) -> list[Any]:
        return [
            e
            for e in self.core.list_namespaced_event(self.ns).items
            if e.involved_object.name == name and e.involved_object.kind == "SGDJob"
        ]

    def reasons(self, name: str) -> list[str]:
        return [e.reason for e in self.events(name)]

    def bind(self, pod: str, node: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self.core.create_namespaced_pod_binding(pod, self.ns, body, _preload_content=False)

    def run_pod(self, pod: str, ip: str, node: str | None = None) -> None:
        """What a kubelet reports once the container is up and ready."""
        if node is not None:
            self.bind(pod, node)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": True,
                    "restartCount": 0,
                    "image": TRAINER_IMAGE,
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
            ],
        }
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def refuse_pod(self, pod: str, message: str) -> None:
        """What kube-scheduler reports on a pod that no node fits."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        refused = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        status = {"phase": "Pending", "conditions": [{**refused, "lastTransitionTime": now}]}
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def end_pod(self, pod: str, exit_code: int) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        term = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": now,
            "finishedAt": now,
        }
        status = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": False,
                    "restartCount": 0,
                    "image": TRAINER_IMAGE,
                    "imageID": "",
                    "state": {"terminated": term},
                }
            ],
        }
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def run_all(self, name: str, count: int, ip_base: int = 10) -> dict[str, Any]:
        pods = wait_for(f"{count} worker pods of {name}", lambda: (p := self.pods(name)) and len(p) == count and p)
        for i in range(count):
            self.run_pod(f"{name}-worker-{i}", f"127.0.{ip_base}.{i + 2}", node=f"node-{i}")
        return pods


def _reaper(core: client.CoreV1Api, ns: str, stop: threading.Event) -> None:
    """The kubelet's part of a deletion: a bound pod stays Terminating until its kubelet confirms."""
    while not stop.wait(0.3):
        try:
            for pod in core.list_namespaced_pod(ns).items:
                if pod.metadata.deletion_timestamp:
                    core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
        except client.ApiException:
            continue


@pytest.fixture
def cluster(k8s_crd: ControlPlane) -> Iterator[Cluster]:
    api = config.new_client_from_config(str(k8s_crd.kubeconfig))
    core = client.CoreV1Api(api)
    ns = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": ns}})
    # No controller-manager here: the service-account controller that would add `default` is absent.
    core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    stop = threading.Event()
    reaper = threading.Thread(target=_reaper, args=(core, ns, stop), daemon=True)
    reaper.start()
    yield Cluster(k8s_crd, ns, core, client.CustomObjectsApi(api))
    stop.set()
    reaper.join(timeout=5)
    custom = client.CustomObjectsApi(api)
    for job in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job["metadata"]["name"])
