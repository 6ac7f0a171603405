"""SGDJob scenarios on the local cluster (e2e/test_scenarios*.py): manifests, jobs, pods, the operator."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from devcluster.kube import KubeApi
from devcluster.testing import Obj, wait_for

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


def assert_children_gone(kube: KubeApi, ns: str, job: str, timeout: float = 180) -> None:
    """Pods (by label), Service, Secret and ConfigMaps of `job` all deleted (the operator and the GC).
    On real nodes a job deleted right after it finished took 71 s here once (8.5 s when deleted
    minutes later), hence the margin; where the time goes is not known yet."""

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


class Env:
    """One scenario module's world: a namespace of its own on a cluster with an operator watching it.
    What a scenario needs of the cluster is behind these methods (on real nodes: e2e/real.py's
    RealEnv), so a scenario reads as a user's steps."""

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
