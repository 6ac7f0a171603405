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
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.images import ImageBuilder
from devcluster.kube import KubeApi, pod_path
from devcluster.pytest_plugin import REAL_NODES
from devcluster.realdaemons import DAEMON_NICE
from devcluster.realnodes import RealCluster
from devcluster.testing import new_namespace, phase_in, wait_for

pytestmark = pytest.mark.realnode(images=["operator", "trainer"])
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


def _nice(pid: int, task: str) -> int:
    stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19; the name in (...) may hold spaces


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
    # The imports ran containerd at normal priority; afterwards every thread of it is back at the
    # daemons' nice, so the containers it starts do not crowd out the rest of the machine.
    for i in range(REAL_NODES):
        pid = real_cluster.daemons.pids[f"node-{i}.containerd"]
        nice = {_nice(pid, task) for task in os.listdir(f"/proc/{pid}/task")}
        assert nice == {DAEMON_NICE}, f"node-{i}'s containerd threads at nice {nice}"
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


DNS_CLIENT = """
import json, socket, sys, time
ns = sys.argv[1]

def resolve(name, wait):
    # The feeder lists every 0.5 s and an endpoint appears once its pod runs: retry cluster names.
    t0 = time.monotonic()
    while True:
        t = time.monotonic()
        try:
            ips = sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET, socket.SOCK_STREAM)})
            return {"ips": ips, "s": round(time.monotonic() - t, 3), "waited": round(t - t0, 1)}
        except socket.gaierror as err:
            if time.monotonic() - t0 > wait:
                return {"error": str(err), "s": round(time.monotonic() - t, 3), "waited": round(t - t0, 1)}
        time.sleep(0.2)

out = {"resolv.conf": open("/etc/resolv.conf").read()}
names = ["web", f"web.{ns}", f"web.{ns}.svc", f"web.{ns}.svc.cluster.local", f"quick.{ns}",
         f"quick-rdzv.quick.{ns}.svc", "kubernetes.default", "kubernetes.default.svc.cluster.local"]
for name in names:
    out[name] = resolve(name, 60)
for name in ("example.com", "nothing-here"):
    out[name] = resolve(name, 0)
print(json.dumps(out), flush=True)
print("waiting for late", flush=True)
print(json.dumps({"late": resolve(f"late.{ns}", 60), "at": time.time()}), flush=True)
"""


def test_pods_resolve_services_and_pods_through_the_cluster_dns(real_cluster: RealCluster) -> None:
    kube: KubeApi = real_cluster.kube()
    ns = new_namespace(kube, "dns")
    _apply(real_cluster, ns, _service("quick", {"app": "quick"}, 29400, headless=True))
    _apply(real_cluster, ns, _service("web", {"app": "quick"}, 80))
    sleep = ["python3", "-c", "import time; time.sleep(3600)"]
    _apply(real_cluster, ns, _pod("quick-rdzv", "node-0", sleep, labels={"app": "quick"}, subdomain="quick"))
    t0 = time.monotonic()
    _apply(real_cluster, ns, _pod("client", "node-1", ["python3", "-c", DNS_CLIENT, ns]))
    logs = wait_for(lambda: _logs_with(real_cluster, ns, "client", "waiting for late"), 120, "the client's lookups")
    TIMINGS["dns client create -> lookups done (s)"] = round(time.monotonic() - t0, 1)
    created = time.time()
    _apply(real_cluster, ns, _service("late", {"app": "none"}, 80))
    done = wait_for(lambda: phase_in(kube, ns, "client", "Succeeded", "Failed"), 90, "the late Service's lookup")
    logs = real_cluster.kubectl("logs", "-n", ns, "client").stdout
    assert done["status"]["phase"] == "Succeeded", logs
    found = json.loads(logs.splitlines()[0])
    TIMINGS["dns lookups (s, waited)"] = {k: [v.get("s"), v.get("waited")] for k, v in found.items() if k[0] != "r"}
    assert "nameserver 10.250.0.1" in found["resolv.conf"] and f"search {ns}.svc.cluster.local" in found["resolv.conf"]
    svc = kube.get(f"/api/v1/namespaces/{ns}/services/web")["spec"]["clusterIP"]
    rdzv = kube.get(pod_path(ns, "quick-rdzv"))["status"]["podIP"]
    assert rdzv.startswith("10.244.0."), rdzv  # on node-0, the client on node-1
    for name in ("web", f"web.{ns}", f"web.{ns}.svc", f"web.{ns}.svc.cluster.local"):
        assert found[name].get("ips") == [svc], (name, found)
    for name in (f"quick.{ns}", f"quick-rdzv.quick.{ns}.svc"):
        assert found[name].get("ips") == [rdzv], (name, found)
    api = kube.get("/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
    assert found["kubernetes.default"].get("ips") == found["kubernetes.default.svc.cluster.local"].get("ips") == [api]
    for name in ("example.com", "nothing-here"):  # no uplink: an error at once, never a timeout
        assert "error" in found[name] and found[name]["s"] < 0.5, (name, found)
    late = json.loads(logs.splitlines()[2])
    late_ip = kube.get(f"/api/v1/namespaces/{ns}/services/late")["spec"]["clusterIP"]
    assert late["late"].get("ips") == [late_ip], late
    TIMINGS["dns: Service created -> resolved in a pod (s)"] = round(late["at"] - created, 2)
    assert late["at"] - created < 5, late
    real_cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _logs_with(cluster: RealCluster, ns: str, pod: str, text: str) -> str | None:
    logs = cluster.kubectl("logs", "-n", ns, pod, check=False).stdout
    return logs if text in logs else None


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
    subdomain: str | None = None,
) -> dict[str, object]:
    container: dict[str, object] = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
    if ready_port:
        container["readinessProbe"] = {"tcpSocket": {"port": ready_port}, "periodSeconds": 1}
    spec: dict[str, object] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 2,
        "containers": [container],
    }
    if subdomain:  # <name>.<subdomain>.<ns>.svc names the pod, through a headless Service <subdomain>
        spec.update(hostname=name, subdomain=subdomain)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def _service(name: str, selector: dict[str, str], port: int, *, headless: bool = False) -> dict[str, object]:
    spec: dict[str, object] = {"selector": selector, "ports": [{"port": port}]}
    if headless:  # as the operator's: the rendezvous pod is named before it is ready
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def _apply(cluster: RealCluster, ns: str, obj: dict[str, object]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=json.dumps(obj))


def _ready(kube: KubeApi, ns: str, name: str) -> dict[str, Any] | None:
    pod = kube.get_or_none(pod_path(ns, name))
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None
