"""SGDJob scenarios on the local cluster (tests/e2e/test_scenarios*.py): manifests, jobs, pods, the operator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster.cluster import LocalCluster
from devcluster.kube import KubeApi
from devcluster.testing import Obj, new_namespace, wait_for

SGDJOBS = "/apis/sgdjob.dev/v1alpha1/namespaces/{ns}/sgdjobs"
LABEL_JOB = "sgdjob.dev/job-name"


def sgdjob_manifest(
    name: str,
    *,
    steps: int,
    checkpoint_dir: str,
    replicas: int = 3,
    min_replicas: int = 2,
    max_replicas: int = 3,
    mode: str = "auto",
    **extra: Any,
) -> str:
    """A small quickstart-shaped SGDJob as JSON (valid YAML for kubectl): emulated compute, one GPU per
    worker (so the scheduler spreads workers over the GPU nodes), checkpoints in `checkpoint_dir`.
    `extra` keys: `emulation` (merged into training.emulation), `policy`, `template` (replace), `training` (merged)."""
    emulation = {"computeSeconds": 0.02, **extra.get("emulation", {})}
    training = {
        "model": "mlp",
        "dataset": "synthetic",
        "batchSize": 16,
        "steps": steps,
        "checkpoint": {"dir": checkpoint_dir, "intervalSteps": 50},
        "emulation": emulation,
    }
    training.update(extra.get("training", {}))
    policy = {
        "intervalSeconds": 2,
        "persistenceIntervals": 2,
        "cooldownSeconds": 10,
        "allowedActions": [],
        **extra.get("policy", {}),
    }
    template = extra.get("template") or {
        "spec": {"containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}
    }
    spec = {
        "replicas": replicas,
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "nprocPerNode": 1,
        "mode": mode,
        "training": training,
        "policy": policy,
        "template": template,
    }
    return json.dumps(
        {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": name}, "spec": spec}, indent=1
    )


def get_job(kube: KubeApi, ns: str, name: str) -> Obj | None:
    return kube.get_or_none(f"{SGDJOBS.format(ns=ns)}/{name}")


def job_status(kube: KubeApi, ns: str, name: str) -> Obj:
    return (get_job(kube, ns, name) or {}).get("status") or {}


def worker_pods(kube: KubeApi, ns: str, job: str) -> list[Obj]:
    """The job's worker pods (terminating ones included), by name."""
    pods = kube.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=f"{LABEL_JOB}={job},sgdjob.dev/role=worker")["items"]
    return sorted(pods, key=lambda p: str(p["metadata"]["name"]))


def job_events(kube: KubeApi, ns: str, name: str) -> list[Obj]:
    """Events about the SGDJob (what `kubectl describe sgdjob` lists), oldest first."""
    items = kube.get(
        f"/api/v1/namespaces/{ns}/events", fieldSelector=f"involvedObject.kind=SGDJob,involvedObject.name={name}"
    )["items"]
    return sorted(items, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))


def kubectl_table(env: Env, *args: str) -> list[dict[str, str]]:
    """`kubectl get ...` as rows of {COLUMN: value}, cut at the header's column starts (a blank cell stays '')."""
    lines = [ln for ln in env.kubectl("get", *args).stdout.splitlines() if ln.strip()]
    if not lines:
        return []
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    rows = []
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], len(line) + 1], strict=True)]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def http_json(url: str, timeout: float = 3.0) -> Obj | None:
    """GET a JSON document (a worker's /status); None when it does not answer."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # loopback pod IPs only
            doc = json.loads(resp.read())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, urllib.error.URLError):
        return None


def assert_children_gone(kube: KubeApi, ns: str, job: str, timeout: float = 90) -> None:
    """Pods (by label), Service, Secret and ConfigMaps of `job` all deleted (the operator and the GC)."""

    def left() -> list[str]:
        out = [
            f"pod/{p['metadata']['name']}"
            for p in kube.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=f"sgdjob.dev/job-name={job}")["items"]
        ]
        for plural, name in (
            ("services", job),
            ("secrets", f"{job}-control"),
            ("configmaps", f"{job}-config"),
            ("configmaps", f"{job}-policy-state"),
        ):
            if kube.get_or_none(f"/api/v1/namespaces/{ns}/{plural}/{name}") is not None:
                out.append(f"{plural}/{name}")
        return out

    wait_for(lambda: not left(), timeout, f"pods, Service, Secret and ConfigMaps of {job} deleted")
    assert get_job(kube, ns, job) is None


class OperatorProcess:
    """`sgdjob operator` as a subprocess watching one namespace; `kill()` is a crash (SIGKILL, no
    clean-up), `stop()` a clean shutdown. Its own session, so no pod process is its child."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path) -> None:
        self.kubeconfig, self.namespace, self.log = kubeconfig, namespace, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        argv = [
            str(Path(sys.executable).parent / "sgdjob"),
            "operator",
            "--namespace",
            self.namespace,
            "--kubeconfig",
            str(self.kubeconfig),
            "--resync",
            "3",
        ]
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        return self

    def _signal(self, sig: signal.Signals, wait: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 20)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, 10)

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


class Env:
    """One scenario module's world: a namespace of its own on a cluster with an operator watching it.
    What differs between the process-node cluster (ProcessEnv) and real nodes (tests/e2e/real.py:
    RealEnv) is behind these methods, so one scenario reads the same on both."""

    kube: KubeApi
    ns: str
    tmp: Path

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def apply(self, manifest: str) -> None:
        self.kubectl("apply", "-n", self.ns, "-f", "-", input_text=manifest)

    def manifest(self, name: str, *, checkpoint_dir: str, **kwargs: Any) -> str:
        """sgdjob_manifest, with whatever this cluster needs for `checkpoint_dir` to be shared by the pods."""
        return sgdjob_manifest(name, checkpoint_dir=checkpoint_dir, **kwargs)

    def logs(self, pod: str) -> str:
        """What `kubectl logs` shows of the pod's trainer."""
        raise NotImplementedError

    def pod_json(self, pod: Obj, port: int, path: str) -> Obj | None:
        """GET a JSON document from a pod's port (a trainer's /status); None when it does not answer."""
        raise NotImplementedError

    def crash_operator(self, down_s: float = 3.0) -> None:
        """SIGKILL the operator (no clean-up), leave the jobs without it for `down_s`, and return once
        an operator runs again."""
        raise NotImplementedError


@dataclass
class ProcessEnv(Env):
    """The process-node cluster (devcluster/cluster.py) with `sgdjob operator` as a host process."""

    cluster: LocalCluster
    kube: KubeApi
    ns: str
    operator: OperatorProcess
    tmp: Path

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.plane.kubectl(*args, check=check, input_text=input_text)

    def logs(self, pod: str) -> str:
        return self.cluster.agent.logs(self.ns, pod)

    def pod_json(self, pod: Obj, port: int, path: str) -> Obj | None:
        return http_json(f"http://{pod['status']['podIP']}:{port}{path}")

    def crash_operator(self, down_s: float = 3.0) -> None:
        self.operator.kill()
        time.sleep(down_s)
        self.operator.start()


@contextmanager
def scenario_env(cluster: LocalCluster, prefix: str, tmp: Path) -> Iterator[ProcessEnv]:
    with operator_namespace(cluster, prefix, tmp) as (ns, op):
        yield ProcessEnv(cluster, cluster.kube(), ns, op, tmp)


@contextmanager
def operator_namespace(cluster: LocalCluster, prefix: str, workdir: Path) -> Iterator[tuple[str, OperatorProcess]]:
    """A fresh namespace with an operator watching it; on exit every SGDJob in it is deleted and its
    pods are waited out before the operator stops (so no trainer outlives the module)."""
    kube = cluster.kube()
    ns = new_namespace(kube, prefix)
    op = OperatorProcess(cluster.kubeconfig, ns, workdir / "operator.log").start()
    try:
        yield ns, op
    finally:
        cluster.plane.kubectl("delete", "sgdjobs", "--all", "-n", ns, "--wait=false", check=False)
        try:
            wait_for(lambda: not kube.get(f"/api/v1/namespaces/{ns}/pods")["items"], 60, f"pods in {ns} gone")
        finally:
            op.stop()
            print(f"--- operator log tail ---\n{op.tail()}")
