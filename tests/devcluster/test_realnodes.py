"""The real-node cluster (devcluster/realnodes.py): kubelets with their own containerd, network and mount
namespaces; pods on two nodes talk over the pod network, through a Service (kube-proxy) and to the
API; `kubectl logs`/`exec` work; the host gets no interface, route or iptables rule; and after stop()
nothing is left (processes, namespaces, cgroups, mounts, files).

The `real_cluster` fixture (devcluster/pytest_plugin.py) brings the cluster up and checks that nothing
is left after it. Root only: without root or the node binaries these tests skip saying why; with
SGDJOB_REQUIRE_K8S=1 they fail instead. Missing Debian packages (containerd, runc, CNI plugins,
iptables, buildah, debootstrap) are installed with apt-get. Timings are printed (run with -s).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster.images import ImageBuilder
from devcluster.kube import KubeApi, pod_path
from devcluster.pytest_plugin import REAL_NODES
from devcluster.realnodes import RealCluster
from devcluster.testing import new_namespace, phase_in, wait_for

pytestmark = pytest.mark.realnode
IMAGE = "python:3.11-slim-bookworm"  # the small base image, imported into every node
TIMINGS: dict[str, object] = {}


def _host_network() -> dict[str, str]:
    """The host's own interfaces, routes and iptables rules: none of it may change."""
    out = {}
    for name, argv in {
        "links": ["ip", "-o", "link"],
        "routes": ["ip", "route", "show", "table", "all"],
        "iptables": ["iptables-save"],
    }.items():
        text = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        # Counters in iptables-save output change by themselves; the rules must not.
        out[name] = "\n".join(line for line in text.splitlines() if not line.startswith(("#", ":")))
    return out


@pytest.fixture(scope="module", autouse=True)
def _print_timings() -> Iterator[None]:
    yield
    print(f"\nreal-node test timings: {json.dumps(TIMINGS)}")


def test_every_node_ready_and_the_host_untouched(real_cluster: RealCluster) -> None:
    TIMINGS["cluster up phases (s)"] = real_cluster.timings
    nodes = {n["metadata"]["name"]: n for n in real_cluster.kube().get("/api/v1/nodes")["items"]}
    assert sorted(nodes) == [f"node-{i}" for i in range(REAL_NODES)]
    ips = {
        name: [a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"] for name, n in nodes.items()
    }
    assert ips == {f"node-{i}": [f"10.250.0.{10 + i}"] for i in range(REAL_NODES)}
    for n in nodes.values():
        info = n["status"]["nodeInfo"]
        assert info["kubeletVersion"] == "v1.20.2" and info["containerRuntimeVersion"].startswith("containerd://")
    # Nothing of the cluster on the host: every address lives inside the cluster's namespaces.
    host = _host_network()
    for needle in ("10.250.0.", "10.244.", "10.96.", "cni0", "fab0", "KUBE-"):
        assert not [k for k, text in host.items() if needle in text], f"{needle} on the host: {host}"


def test_pods_on_two_nodes_talk_directly_through_a_service_and_to_the_api(real_cluster: RealCluster) -> None:
    kube: KubeApi = real_cluster.kube()
    ns = new_namespace(kube, "rn")
    t0 = time.monotonic()
    serve = "mkdir -p /tmp/www && hostname > /tmp/www/name && cd /tmp/www && exec python3 -m http.server 8080"
    _apply(real_cluster, ns, _pod("web", "node-1", ["sh", "-c", serve], labels={"app": "web"}, ready_port=8080))
    _apply(
        real_cluster,
        ns,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    web = wait_for(lambda: _ready(kube, ns, "web"), 120, "pod web Ready on node-1")
    TIMINGS["server pod create -> Ready (s)"] = round(time.monotonic() - t0, 1)
    web_ip, svc_ip = web["status"]["podIP"], kube.get(f"/api/v1/namespaces/{ns}/services/web")["spec"]["clusterIP"]
    assert web_ip.startswith("10.244.1.") and svc_ip.startswith("10.96.")

    t0 = time.monotonic()
    client = textwrap.dedent(
        f"""
        import os, ssl, time, urllib.request
        env = os.environ
        targets = {{
            "pod": "http://{web_ip}:8080/name",
            "service": "http://{svc_ip}:80/name",
            "service-env": "http://%s:%s/name" % (env["WEB_SERVICE_HOST"], env["WEB_SERVICE_PORT"]),
            "api": "https://%s:%s/version" % (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]),
        }}
        ok = True
        for name, url in targets.items():
            # kube-proxy programs a new Service a moment after its endpoint turns ready: retry.
            for attempt in range(60):
                try:
                    body = urllib.request.urlopen(url, timeout=3, context=ssl._create_unverified_context()).read()
                    print("OK", name, url, body.decode().strip().replace(chr(10), " ")[:80], flush=True)
                    break
                except Exception as err:
                    last = err
                    time.sleep(0.5)
            else:
                ok = False
                print("ERR", name, url, repr(last), flush=True)
        raise SystemExit(0 if ok else 1)
        """
    )
    _apply(real_cluster, ns, _pod("client", "node-2", ["python3", "-c", client]))
    done = wait_for(lambda: phase_in(kube, ns, "client", "Succeeded", "Failed"), 120, "client pod to finish")
    TIMINGS["client pod create -> Succeeded (s)"] = round(time.monotonic() - t0, 1)
    logs = real_cluster.kubectl("logs", "-n", ns, "client").stdout
    assert done["status"]["phase"] == "Succeeded", logs
    assert done["spec"]["nodeName"] == "node-2" and done["status"]["podIP"].startswith("10.244.2.")
    for name in ("pod", "service", "service-env"):
        assert f"OK {name} " in logs and logs.split(f"OK {name} ", 1)[1].split("\n", 1)[0].endswith(" web"), logs
    assert '"gitVersion": "v1.20.2"' in logs, logs
    # No NAT between nodes: the server saw the client's own pod IP.
    server_log = real_cluster.kubectl("logs", "-n", ns, "web").stdout
    assert done["status"]["podIP"] in server_log, server_log
    exec_out = real_cluster.kubectl("exec", "-n", ns, "web", "--", "cat", "/tmp/www/name").stdout
    assert exec_out.strip() == "web"
    real_cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_project_images_run_on_the_nodes(real_cluster: RealCluster) -> None:
    """The Dockerfile's two targets, built with buildah (cached by their sources), run as pods."""
    builder = ImageBuilder()
    t0 = time.monotonic()
    images = [builder.project("operator"), builder.project("trainer")]
    TIMINGS["project images (s)"] = {**builder.timings, "total": round(time.monotonic() - t0, 1)}
    TIMINGS["project images import (s)"] = real_cluster.import_images(images)
    kube = real_cluster.kube()
    ns = new_namespace(kube, "img")
    check = "import torch, sgdjob_trainer; print('trainer', torch.__version__, sgdjob_trainer.__name__)"
    _apply(real_cluster, ns, _pod("trainer", "node-0", ["python", "-c", check], image="sgdjob/trainer:dev"))
    _apply(real_cluster, ns, _pod("operator", "node-1", ["sgdjob", "--help"], image="sgdjob/operator:dev"))
    for name in ("trainer", "operator"):
        pod = wait_for(lambda n=name: phase_in(kube, ns, n, "Succeeded", "Failed"), 180, f"{name} pod")  # type: ignore[misc]
        logs = real_cluster.kubectl("logs", "-n", ns, name).stdout
        assert pod["status"]["phase"] == "Succeeded", logs
        assert ("trainer 2.13.0" in logs) if name == "trainer" else ("operator" in logs), logs
    real_cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _pod(
    name: str,
    node: str,
    command: list[str],
    *,
    image: str = IMAGE,
    labels: dict[str, str] | None = None,
    ready_port: int | None = None,
    restart: str = "Never",
) -> dict[str, object]:
    container: dict[str, object] = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
    if ready_port:
        container["readinessProbe"] = {"tcpSocket": {"port": ready_port}, "periodSeconds": 1}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 2,
            "containers": [container],
        },
    }


def _apply(cluster: RealCluster, ns: str, obj: dict[str, object]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=json.dumps(obj))


def _ready(kube: KubeApi, ns: str, name: str) -> dict[str, Any] | None:
    pod = kube.get_or_none(pod_path(ns, name))
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None
