"""The scenarios' world on real nodes (devcluster/realnodes.py): the operator installed with `helm install`
from charts/sgdjob-operator as a Deployment running the project's `sgdjob/operator:dev` image (non-root,
read-only root filesystem, liveness probe), its validating webhook reached by the API server through the
webhook's Service with a certificate made here, and workers from `sgdjob/trainer:dev`.

The local cluster has no GPUs: every node advertises `nvidia.com/gpu: 1` as an extended resource (the
documented PATCH of the node's status), so the scheduler places one-GPU workers as on a GPU cluster.
Checkpoints live in a host folder that every node mounts as a hostPath volume at the same path: the
nodes share the host's filesystem, as pods on a real cluster would share a network volume.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster import realfaults
from devcluster.images import ImageBuilder
from devcluster.kube import KubeApi, KubeError
from devcluster.realnodes import RealCluster
from devcluster.testing import Obj, new_namespace, wait_for
from e2e.helpers import Env, sgdjob_manifest
from tests.packaging.helm import helm_kc
from tests.packaging.test_chart import CHART
from tests.packaging.test_webhook import make_certs

RELEASE, OPERATOR_NS = "sgdjob-operator", "sgdjob-system"  # fullname = the release name
OPERATOR_LABELS = f"app.kubernetes.io/instance={RELEASE}"
# What install_operator puts on the nodes; modules name them in their realnode marker, so the session's
# cluster has them imported before the first real-node test (devcluster/pytest_plugin.py).
OPERATOR_IMAGES = ["operator", "trainer"]
GPUS_PER_NODE = 1
OPERATOR_REPLICAS = 2
DEV_VALUES = Path(__file__).resolve().parents[1] / "devcluster" / "helm-values.yaml"


def advertise_gpus(kube: KubeApi, nodes: list[str], count: int = GPUS_PER_NODE) -> None:
    for node in nodes:
        patch = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(count)}]
        kube.patch(f"/api/v1/nodes/{node}/status", patch, kind="json")
    wait_for(
        lambda: all(
            n["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(count)
            for n in kube.get("/api/v1/nodes")["items"]
        ),
        60,
        "nvidia.com/gpu allocatable on every node",
    )


@dataclass
class RealOperator:
    """The Helm release's operator pod on the real cluster."""

    cluster: RealCluster
    kube: KubeApi
    timings: dict[str, float]
    values: Path  # the values this install added to DEV_VALUES

    def helm_values(self) -> tuple[str, ...]:
        """The `helm` options of the release's values (install, upgrade, template)."""
        return ("-f", str(DEV_VALUES), "-f", str(self.values))

    def pods(self) -> list[Obj]:
        """The release's running, ready operator pods (leader and standbys)."""
        found = []
        for pod in self.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods", labelSelector=OPERATOR_LABELS)["items"]:
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
            if ready and not pod["metadata"].get("deletionTimestamp"):
                found.append(dict(pod))
        return found

    def leader_name(self) -> str:
        """The pod whose process holds the Lease now ('' while nobody does): the identity is
        `<pod name>_<process id>`."""
        try:
            lease = self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NS}/leases/{RELEASE}")
        except KubeError:
            return ""
        holder = str((lease.get("spec") or {}).get("holderIdentity") or "")
        return holder.rpartition("_")[0]

    def pod(self) -> Obj | None:
        """The ready pod of the leader (None while there is none: a failover, a restart)."""
        leader = self.leader_name()
        return next((p for p in self.pods() if p["metadata"]["name"] == leader), None)

    def restarts(self, name: str) -> int:
        pod = self.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods/{name}")
        return sum(int(c.get("restartCount", 0)) for c in pod["status"].get("containerStatuses", []))

    def host_pids(self, pod: Obj) -> list[int]:
        """The operator container's processes as the host sees them (its pod's cgroup)."""
        tag = f"pod{pod['metadata']['uid']}"
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if tag in (entry / "cgroup").read_text() and b"operator" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def crash(self, down_s: float = 3.0) -> None:
        """SIGKILL the leader's process from the host, as the kernel's OOM killer would; the kubelet
        restarts the container (restartPolicy Always) and a leader (the standby, or the restarted one
        once the old lease expires) takes over. Returns once the crashed container is back and ready
        and a leader holds the Lease again."""
        pod = wait_for(self.pod, 120, "a ready operator leader")
        name = pod["metadata"]["name"]
        before = self.restarts(name)
        pids = self.host_pids(pod)
        assert pids, f"no process of operator pod {name} found on the host"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        time.sleep(down_s)
        wait_for(
            lambda: self.restarts(name) > before and any(p["metadata"]["name"] == name for p in self.pods()),
            180,
            f"operator pod {name} restarted and ready",
        )
        wait_for(self.pod, 120, "a leader again")

    def logs(self, tail: int = 80) -> str:
        result = self.cluster.kubectl(
            "logs", "-n", OPERATOR_NS, "-l", OPERATOR_LABELS, f"--tail={tail}", "--all-containers", check=False
        )
        return result.stdout + result.stderr


def install_operator(
    cluster: RealCluster, workdir: Path, resync_s: int = 3, extra_args: Sequence[str] = ()
) -> RealOperator:
    """Build (cached) and import the project's images, advertise GPUs, and `helm install` the chart with
    its webhook on (`extra_args`: more operator arguments, e.g. --verbose); returns once the operator pod
    is ready and its webhook answers through the Service."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    builder = ImageBuilder()
    images = [builder.get(name) for name in OPERATOR_IMAGES]
    timings["image builds"] = round(time.monotonic() - t0, 1)
    t1 = time.monotonic()
    cluster.import_images(images)
    timings["image imports"] = round(time.monotonic() - t1, 1)
    kube = cluster.kube()
    advertise_gpus(kube, cluster.node_names())
    certs = workdir / "webhook-certs"
    certs.mkdir(parents=True, exist_ok=True)
    ca, crt, key = make_certs(certs, dns=f"{RELEASE}-webhook.{OPERATOR_NS}.svc")
    cluster.kubectl("create", "namespace", OPERATOR_NS)
    cluster.kubectl(
        "create", "secret", "tls", "webhook-tls", "-n", OPERATOR_NS, f"--cert={crt}", f"--key={key}"
    )  # fmt: skip
    t2 = time.monotonic()
    # On top of the README's values for this cluster (the images `up` imports).
    values = {
        # A short resync: the tests wait less.
        "extraArgs": ["--resync", str(resync_s), *extra_args],
        # High availability as an admin runs it: a leader and a hot standby on another node, so that
        # losing any one node (the leader's too, e2e/test_chaos.py) leaves an operator.
        "replicaCount": OPERATOR_REPLICAS,
        "webhook": {
            "enabled": True,
            "certSecret": "webhook-tls",
            "caBundle": base64.b64encode(ca.read_bytes()).decode(),
        },
    }
    (workdir / "values.json").write_text(json.dumps(values))
    op = RealOperator(cluster, kube, timings, workdir / "values.json")
    helm_kc(
        cluster, "install", RELEASE, str(CHART), "-n", OPERATOR_NS, *op.helm_values(),
        "--wait", "--timeout", "5m", timeout=400,
    )  # fmt: skip
    _serving(op)
    timings["helm install to ready"] = round(time.monotonic() - t2, 1)
    return op


def upgrade_operator(op: RealOperator, *options: str) -> None:
    """`helm upgrade` of the release with its values and `options`; returns once the new pods are ready,
    one leading, and the webhook answers again."""
    helm_kc(
        op.cluster, "upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, *op.helm_values(), *options,
        "--wait", "--timeout", "5m", timeout=400,
    )  # fmt: skip
    _serving(op)


def uninstall_operator(op: RealOperator) -> None:
    """`helm uninstall`: the release's pods, Deployment, ServiceAccount, Services and RBAC go; the CRD
    stays (Helm never deletes what a chart's crds/ folder installed)."""
    helm_kc(op.cluster, "uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "2m", timeout=200)
    kubectl = op.cluster.kubectl
    wait_for(lambda: not op.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods", labelSelector=OPERATOR_LABELS)["items"],
             120, "the operator pods gone")  # fmt: skip
    left = kubectl("get", "clusterrole,clusterrolebinding", "-l", OPERATOR_LABELS, "-o", "name").stdout.strip()
    left += kubectl(
        "-n", OPERATOR_NS, "get", "deploy,sa,svc,role,rolebinding", "-l", OPERATOR_LABELS, "-o", "name"
    ).stdout
    assert not left.strip(), f"left after helm uninstall: {left}"
    assert kubectl("get", "crd", "sgdjobs.sgdjob.dev", "-o", "name", check=False).returncode == 0, "the CRD is kept"


def _serving(op: RealOperator) -> None:
    wait_for(lambda: len(op.pods()) == OPERATOR_REPLICAS and op.pod(), 120, "the operator pods ready, one leading")
    # Ready is the liveness port; the webhook's Service may trail it by a moment (endpoints, kube-proxy).
    wait_for(lambda: _webhook_answers(op.cluster), 120, "the webhook answering through its Service")


def _webhook_answers(cluster: RealCluster) -> bool:
    """A server-side dry run of a cross-field-invalid job is refused by the webhook (not by a timeout)."""
    job = json.loads(sgdjob_manifest("probe", steps=1, checkpoint_dir="/tmp", replicas=2, min_replicas=3))
    result = cluster.kubectl(
        "apply", "-n", "default", "--dry-run=server", "-f", "-", input_text=json.dumps(job), check=False
    )
    return result.returncode != 0 and "minReplicas" in result.stderr and "validate.sgdjob.dev" in result.stderr


@dataclass
class RealEnv(Env):
    """A namespace on the real cluster, watched by the Helm-installed operator (all namespaces)."""

    cluster: RealCluster
    kube: KubeApi
    ns: str
    operator: RealOperator
    tmp: Path

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check, input_text=input_text)

    def manifest(self, name: str, *, checkpoint_dir: str, **kwargs: Any) -> str:
        # The trainer runs as uid 10001; the folder is the host's, mounted into every worker.
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        Path(checkpoint_dir).chmod(0o777)
        job = json.loads(sgdjob_manifest(name, checkpoint_dir=checkpoint_dir, **kwargs))
        spec = job["spec"]["template"].setdefault("spec", {})
        spec.setdefault("volumes", []).append(
            {"name": "checkpoints", "hostPath": {"path": checkpoint_dir, "type": "Directory"}}
        )
        for container in spec.get("containers", []):
            if container["name"] == "trainer":
                mounts = container.setdefault("volumeMounts", [])
                mounts.append({"name": "checkpoints", "mountPath": checkpoint_dir})
        return json.dumps(job, indent=1)

    def logs(self, pod: str) -> str:
        return self.cluster.kubectl("logs", "-n", self.ns, pod, check=False).stdout

    def pod_json(self, pod: Obj, port: int, path: str) -> Obj | None:
        # Through the API server's pod proxy: the pod network is not reachable from the host.
        name = pod["metadata"]["name"]
        try:
            doc = KubeApi(self.cluster.kubeconfig, timeout=3).get(
                f"/api/v1/namespaces/{self.ns}/pods/{name}:{port}/proxy{path}"
            )
        except (KubeError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def crash_operator(self, down_s: float = 3.0) -> None:
        self.operator.crash(down_s)

    def job_logs(self, job: str) -> dict[str, str]:
        """Every worker container's log the nodes still hold (each life is a file), by path."""
        return self.cluster.pod_logs(self.ns, f"{job}-worker-")

    def fail_node(self, node: str) -> None:
        self.cluster.fail_node(node)

    def recover_node(self, node: str) -> None:
        self.cluster.recover_node(node)
        # The kubelet keeps extended resources it did not make across its restart (its device
        # checkpoint survives); advertising again makes sure the node takes one-GPU pods at once.
        advertise_gpus(self.kube, self.cluster.node_names())

    def start_kubelet(self, node: str) -> None:
        realfaults.start_kubelet(self.cluster, node)
        advertise_gpus(self.kube, self.cluster.node_names())  # as after recover_node

    def operator_node(self) -> str:
        pod = wait_for(self.operator.pod, 120, "a ready operator pod")
        return str(pod["spec"].get("nodeName"))


@contextmanager
def real_scenario_env(cluster: RealCluster, operator: RealOperator, prefix: str, tmp: Path) -> Iterator[RealEnv]:
    """A fresh namespace; on exit its SGDJobs are deleted and their pods waited out."""
    kube = cluster.kube()
    ns = new_namespace(kube, prefix)
    try:
        yield RealEnv(cluster, kube, ns, operator, tmp)
    finally:
        cluster.kubectl("delete", "sgdjobs", "--all", "-n", ns, "--wait=false", check=False)
        try:
            wait_for(lambda: not kube.get(f"/api/v1/namespaces/{ns}/pods")["items"], 90, f"pods in {ns} gone")
        finally:
            print(f"--- operator log tail ---\n{operator.logs()}")
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
