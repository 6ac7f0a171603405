"""The node agent against a real control plane: what a kubelet must do for the e2e scenarios to mean anything.

Pods are applied with the real kubectl, scheduled by the real scheduler, owned by real controllers
(Deployment -> ReplicaSet, Endpoints, garbage collection); only the kubelet is ours.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.cluster import LocalCluster
from devcluster.kube import KubeApi, pod_path
from devcluster.node_agent import NodeAgent, NodeSpec
from devcluster.proctree import alive, tagged_pids
from devcluster.testing import apply, container_pid, new_namespace, phase_in, script, wait_for

pytestmark = pytest.mark.k8s
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def kube(cluster: LocalCluster) -> KubeApi:
    return cluster.kube()


@pytest.fixture(scope="module")
def ns(kube: KubeApi) -> Iterator[str]:
    name = new_namespace(kube, "agent")
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


ENV_SCRIPT = script("""
    import json, os, socket, sys
    keys = ["POD_NAME", "POD_NAMESPACE", "POD_UID", "NODE_NAME", "POD_IP", "HOST_IP", "SECRET_TOKEN", "GREETING",
            "CFG_mode", "DERIVED", "CPU_LIMIT", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "DATA_DIR"]
    with open("/scratch/out.txt", "w") as f:
        f.write("written")
    print(json.dumps({
        "argv": sys.argv[1:], "exe": sys.executable, "cwd": os.getcwd(), "hostname": socket.gethostname(),
        "env": {k: os.environ.get(k) for k in keys},
        "greeting_file": open("/etc/app/greeting").read(),
        "secret_file": open("/etc/secret/token").read(),
        "sa_namespace": open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read(),
        "scratch": open(os.path.join(os.environ["DATA_DIR"], "out.txt")).read(),
        "init": open("/scratch/init.txt").read().strip(),
    }))
""")


def test_pod_runs_to_completion_with_env_volumes_and_exit_code(cluster: LocalCluster, kube: KubeApi, ns: str) -> None:
    apply(
        cluster,
        ns,
        f"""
        apiVersion: v1
        kind: ConfigMap
        metadata: {{name: app-config}}
        data: {{greeting: hello, mode: sync}}
        ---
        apiVersion: v1
        kind: Secret
        metadata: {{name: app-secret}}
        stringData: {{token: s3cret}}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: envcheck}}
        spec:
          restartPolicy: Never
          initContainers:
          - {{name: init, image: busybox, command: [sh, -c, "echo init-ran > /scratch/init.txt"], \
volumeMounts: [{{name: scratch, mountPath: /scratch}}]}}
          containers:
          - name: main
            image: ignored.example/python:3.11
            command: [python, -c, {ENV_SCRIPT}]
            args: ["$(POD_NAME)", /scratch]
            workingDir: /scratch
            resources: {{limits: {{cpu: "2"}}}}
            envFrom: [{{prefix: CFG_, configMapRef: {{name: app-config}}}}]
            env:
            - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
            - {{name: POD_NAMESPACE, valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}}}
            - {{name: POD_UID, valueFrom: {{fieldRef: {{fieldPath: metadata.uid}}}}}}
            - {{name: NODE_NAME, valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}}}
            - {{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
            - {{name: HOST_IP, valueFrom: {{fieldRef: {{fieldPath: status.hostIP}}}}}}
            - {{name: CPU_LIMIT, valueFrom: {{resourceFieldRef: {{resource: limits.cpu}}}}}}
            - {{name: SECRET_TOKEN, valueFrom: {{secretKeyRef: {{name: app-secret, key: token}}}}}}
            - {{name: GREETING, valueFrom: {{configMapKeyRef: {{name: app-config, key: greeting}}}}}}
            - {{name: DERIVED, value: "$(POD_NAME)-$(GREETING)"}}
            - {{name: DATA_DIR, value: /scratch}}
            volumeMounts:
            - {{name: config, mountPath: /etc/app}}
            - {{name: secret, mountPath: /etc/secret, readOnly: true}}
            - {{name: scratch, mountPath: /scratch}}
          volumes:
          - {{name: config, configMap: {{name: app-config}}}}
          - {{name: secret, secret: {{secretName: app-secret}}}}
          - {{name: scratch, emptyDir: {{}}}}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: exit7}}
        spec:
          restartPolicy: Never
          containers:
          - {{name: main, image: busybox, command: [python, -c, "import sys; \
open('/dev/termination-log', 'w').write('seven'); sys.exit(7)"]}}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: lastwords}}
        spec:
          restartPolicy: Never
          containers:
          - {{name: main, image: busybox, terminationMessagePolicy: FallbackToLogsOnError, \
command: [python, -c, "import sys; print('last words', flush=True); sys.exit(3)"]}}
        """,
    )
    pod = wait_for(lambda: phase_in(kube, ns, "envcheck", "Succeeded", "Failed"), 60, "envcheck to finish")
    report = json.loads(cluster.agent.logs(ns, "envcheck"))
    status, meta = pod["status"], pod["metadata"]
    assert status["phase"] == "Succeeded", (status, report)
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "False",
        "Ready": "False",
    }
    assert status["podIP"].startswith("127.") and status["podIP"] != status["hostIP"]
    env = report["env"]
    assert env["POD_NAME"] == "envcheck" and env["POD_NAMESPACE"] == ns and env["POD_UID"] == meta["uid"]
    assert (env["NODE_NAME"], env["POD_IP"], env["HOST_IP"]) == (
        pod["spec"]["nodeName"],
        status["podIP"],
        status["hostIP"],
    )
    assert (env["SECRET_TOKEN"], env["GREETING"], env["CFG_mode"], env["DERIVED"], env["CPU_LIMIT"]) == (
        "s3cret",
        "hello",
        "sync",
        "envcheck-hello",
        "2",
    )
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == (
        "127.0.0.1",
        str(cluster.plane.api_port),
    )
    assert (
        report["greeting_file"],
        report["secret_file"],
        report["sa_namespace"],
        report["scratch"],
        report["init"],
    ) == ("hello", "s3cret", ns, "written", "init-ran")
    assert status["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    # `python` is this checkout's venv interpreter; mount paths in args/env/workingDir point into the pod folder.
    assert report["exe"] == str(Path(sys.executable).parent / "python")
    assert report["argv"][0] == "envcheck" and report["argv"][1] == report["cwd"] == env["DATA_DIR"] != "/scratch"
    assert report["hostname"] == "envcheck"

    failed = wait_for(lambda: phase_in(kube, ns, "exit7", "Succeeded", "Failed"), 30, "exit7 to finish")
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (failed["status"]["phase"], terminated["exitCode"], terminated["reason"]) == ("Failed", 7, "Error")
    assert terminated["message"] == "seven", "what the process wrote at its terminationMessagePath"
    assert "message" not in status["containerStatuses"][0]["state"]["terminated"], "nothing written, no message"
    words = wait_for(lambda: phase_in(kube, ns, "lastwords", "Succeeded", "Failed"), 30, "lastwords to finish")
    assert words["status"]["containerStatuses"][0]["state"]["terminated"]["message"].strip() == "last words"


def test_on_failure_restarts_with_backoff_until_success(cluster: LocalCluster, kube: KubeApi, ns: str) -> None:
    # Fails twice, then succeeds: the emptyDir outlives container restarts, as in Kubernetes.
    apply(
        cluster,
        ns,
        """
        apiVersion: v1
        kind: Pod
        metadata: {name: flaky}
        spec:
          restartPolicy: OnFailure
          containers:
          - name: main
            image: busybox
            command: [sh, -c, 'n=$(cat /data/n 2>/dev/null || echo 0); \
echo $((n+1)) > /data/n; echo "run $n"; test "$n" -ge 2']
            volumeMounts: [{name: data, mountPath: /data}]
          volumes: [{name: data, emptyDir: {}}]
        """,
    )
    seen_backoff = wait_for(
        lambda: any(
            (c.get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"
            for c in (kube.get(pod_path(ns, "flaky"))["status"].get("containerStatuses") or [])
        ),
        30,
        "CrashLoopBackOff",
    )
    pod = wait_for(lambda: phase_in(kube, ns, "flaky", "Succeeded", "Failed"), 30, "flaky to finish")
    ctr = pod["status"]["containerStatuses"][0]
    assert seen_backoff and pod["status"]["phase"] == "Succeeded"
    assert ctr["restartCount"] == 2
    assert ctr["lastState"]["terminated"]["exitCode"] == 1
    assert cluster.agent.logs(ns, "flaky").split() == ["run", "0", "run", "1", "run", "2"]


def test_gpu_pods_schedule_onto_gpu_nodes_only(cluster: LocalCluster, kube: KubeApi, ns: str) -> None:
    pods = "\n---\n".join(
        f"""
        apiVersion: v1
        kind: Pod
        metadata: {{name: gpu-{i}, labels: {{app: gpu}}}}
        spec:
          terminationGracePeriodSeconds: 1
          containers:
          - name: main
            image: ignored
            command: [sh, -c, 'echo "gpus=$NVIDIA_VISIBLE_DEVICES"; exec sleep 60']
            resources: {{limits: {{nvidia.com/gpu: 1}}}}
        """
        for i in range(5)
    )
    apply(cluster, ns, pods)
    gpu_nodes = {
        n["metadata"]["name"] for n in kube.get("/api/v1/nodes", labelSelector="nvidia.com/gpu.present=true")["items"]
    }
    assert len(gpu_nodes) == 4

    def placed() -> tuple[list[Obj], list[Obj]] | None:
        items = kube.get(pod_path(ns), labelSelector="app=gpu")["items"]
        running = [p for p in items if p["status"].get("phase") == "Running"]
        refused = [
            p
            for p in items
            if any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in p["status"].get("conditions", [])
            )
        ]
        return (running, refused) if len(running) == 4 and len(refused) == 1 else None

    running, refused = wait_for(placed, 60, "4 GPU pods running and 1 unschedulable")
    assert {p["spec"]["nodeName"] for p in running} == gpu_nodes  # one per GPU node, none on node-4
    assert "nvidia.com/gpu" in next(
        c["message"] for c in refused[0]["status"]["conditions"] if c["type"] == "PodScheduled"
    )

    def outputs() -> list[str] | None:
        found = [cluster.agent.logs(ns, p["metadata"]["name"]).strip() for p in running]
        return found if all(found) else None  # every pod's, not the first few that have written

    logs = wait_for(outputs, 20, "GPU pods' output")
    assert logs == ["gpus=0"] * 4  # the device plugin's env: each node's only GPU
    cluster.plane.kubectl("delete", "pods", "-n", ns, "-l", "app=gpu", "--wait=false")
    wait_for(lambda: not kube.get(pod_path(ns), labelSelector="app=gpu")["items"], 30, "GPU pods to be gone")


def test_headless_service_names_resolve_to_pod_ips_inside_pods(cluster: LocalCluster, kube: KubeApi, ns: str) -> None:
    assert cluster.agent.isolation, f"per-pod /etc/hosts unavailable: {cluster.agent.isolation_error}"
    server = script("""
        import json, os, socket
        sock = socket.create_server((os.environ["POD_IP"], 7070))  # its own loopback IP: no port clashes
        while True:
            conn, _ = sock.accept()
            conn.sendall(json.dumps({"hostname": socket.gethostname(), "fqdn": socket.getfqdn()}).encode())
            conn.close()
    """)
    client = script(f"""
        import json, socket, time
        names = ["server.peers.{ns}.svc.cluster.local", "server.peers.{ns}.svc", "server.peers", \
"peers.{ns}.svc", "peers"]
        deadline = time.time() + 40
        while True:  # like any client of cluster DNS: the name exists once the server is Ready
            try:
                resolved = {{n: socket.gethostbyname(n) for n in names}}
                with socket.create_connection(("server.peers", 7070), timeout=5) as conn:
                    reply = json.loads(conn.recv(4096))
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        print(json.dumps({{"resolved": resolved, "reply": reply}}))
    """)
    apply(
        cluster,
        ns,
        f"""
        apiVersion: v1
        kind: Service
        metadata: {{name: peers}}
        spec: {{clusterIP: None, selector: {{app: peer}}, ports: [{{port: 7070}}]}}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: server, labels: {{app: peer}}}}
        spec:
          hostname: server
          subdomain: peers
          terminationGracePeriodSeconds: 1
          containers:
          - name: main
            image: ignored
            command: [python, -c, {server}]
            env: [{{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}]
            ports: [{{name: peer, containerPort: 7070}}]
            readinessProbe: {{tcpSocket: {{port: peer}}, periodSeconds: 5}}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: deaf, labels: {{app: peer}}}}
        spec:
          terminationGracePeriodSeconds: 1
          containers:
          - {{name: main, image: ignored, command: [sleep, "60"], readinessProbe: {{tcpSocket: {{port: 7070}}}}}}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {{name: client}}
        spec:
          restartPolicy: Never
          containers: [{{name: main, image: ignored, command: [python, -c, {client}]}}]
        """,
    )
    done = wait_for(lambda: phase_in(kube, ns, "client", "Succeeded", "Failed"), 60, "the DNS client to finish")
    assert done["status"]["phase"] == "Succeeded", cluster.agent.logs(ns, "client")
    report = json.loads(cluster.agent.logs(ns, "client"))
    server_ip = kube.get(pod_path(ns, "server"))["status"]["podIP"]
    assert set(report["resolved"].values()) == {server_ip}  # never the unready pod of the Service
    deaf = kube.get(pod_path(ns, "deaf"))["status"]
    assert deaf["phase"] == "Running" and not deaf["containerStatuses"][0]["ready"]
    assert next(c["status"] for c in deaf["conditions"] if c["type"] == "Ready") == "False"
    assert report["reply"] == {"hostname": "server", "fqdn": f"server.peers.{ns}.svc.cluster.local"}
    cluster.plane.kubectl("delete", "pods", "-n", ns, "-l", "app=peer", "--wait=false")
    wait_for(lambda: not kube.get(pod_path(ns), labelSelector="app=peer")["items"], 30, "the Service's pods to be gone")


STUBBORN = script("""
    import signal, subprocess, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL after the grace period ends this
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)  # escapes the process group, \
like torchrun workers
    print(child.pid, flush=True)
    time.sleep(300)
""")


def test_deleting_a_pod_kills_all_its_processes_and_finalizes_it(cluster: LocalCluster, kube: KubeApi, ns: str) -> None:
    apply(
        cluster,
        ns,
        f"""
        apiVersion: apps/v1
        kind: Deployment
        metadata: {{name: stubborn}}
        spec:
          replicas: 1
          selector: {{matchLabels: {{app: stubborn}}}}
          template:
            metadata: {{labels: {{app: stubborn}}}}
            spec:
              terminationGracePeriodSeconds: 1
              containers: [{{name: main, image: ignored, command: [python, -c, {STUBBORN}]}}]
        """,
    )

    def ready_pods() -> list[Obj]:
        items = kube.get(pod_path(ns), labelSelector="app=stubborn")["items"]
        return [
            p
            for p in items
            if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ]

    first = wait_for(ready_pods, 60, "the Deployment's pod to be Ready")[0]
    name, uid = first["metadata"]["name"], first["metadata"]["uid"]
    child = int(wait_for(lambda: cluster.agent.logs(ns, name).strip(), 20, "the child's pid"))
    main = container_pid(first)
    assert alive(main) and alive(child) and len(tagged_pids(f"{cluster.agent.tag}{uid}/")) == 2
    wait_for(
        lambda: (
            kube.get("/apis/apps/v1/namespaces/" + ns + "/deployments/stubborn")["status"].get("readyReplicas") == 1
        ),
        30,
        "readyReplicas=1",
    )

    started = time.monotonic()
    kube.delete(pod_path(ns, name))
    wait_for(lambda: kube.get_or_none(pod_path(ns, name)) is None, 30, "the deleted pod to be finalized")
    assert time.monotonic() - started >= 0.9  # SIGTERM was ignored: SIGKILL came after the 1 s grace
    assert not alive(main) and not alive(child) and not tagged_pids(f"{cluster.agent.tag}{uid}/")

    second = wait_for(
        lambda: [p for p in ready_pods() if p["metadata"]["uid"] != uid], 60, "the ReplicaSet's replacement"
    )[0]
    assert second["status"]["podIP"] != first["status"]["podIP"]
    cluster.plane.kubectl("delete", "deployment", "stubborn", "-n", ns, "--wait=false")
    wait_for(
        lambda: not kube.get(pod_path(ns), labelSelector="app=stubborn")["items"], 60, "garbage collection of the pods"
    )
    assert not tagged_pids(f"{cluster.agent.tag}{second['metadata']['uid']}/")


def test_node_loss_and_no_process_outlives_the_agent(
    cluster: LocalCluster, kube: KubeApi, ns: str, tmp_path: Path
) -> None:
    # A second agent with a tainted node of its own, so no other test's pod lands there.
    taint = {"key": "sgdjob.dev/spare", "value": "true", "effect": "NoSchedule"}
    spare = NodeAgent(
        cluster.kubeconfig,
        [NodeSpec("spare-0", taints=(taint,))],
        tmp_path / "spare",
        grace_cap=1.0,
        ca_file=cluster.ca_file,
    ).start()
    try:
        apply(
            cluster,
            ns,
            f"""
            apiVersion: v1
            kind: Pod
            metadata: {{name: lonely}}
            spec:
              nodeSelector: {{kubernetes.io/hostname: spare-0}}
              tolerations: [{{key: sgdjob.dev/spare, operator: Exists}}]
              containers: [{{name: main, image: ignored, command: [python, -c, {STUBBORN}]}}]
            """,
        )
        pod = wait_for(lambda: phase_in(kube, ns, "lonely", "Running"), 60, "lonely to run on spare-0")
        wait_for(lambda: spare.logs(ns, "lonely").strip(), 20, "the child's pid")
        before = spare.leftover_pids()
        assert container_pid(pod) in before and len(before) == 2

        spare.fail_node("spare-0")
        assert not any(alive(p) for p in before) and not spare.leftover_pids()
        node = kube.get("/api/v1/nodes/spare-0")
        assert next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready") == "Unknown"
        assert kube.get(pod_path(ns, "lonely"))["status"]["phase"] == "Running"  # a dead kubelet reports nothing

        spare.recover_node("spare-0")

        def rerun() -> Obj | None:
            found = phase_in(kube, ns, "lonely", "Running")
            return found if found and container_pid(found) not in before else None

        again = wait_for(rerun, 30, "lonely to run again")
        wait_for(lambda: len(spare.leftover_pids()) == 2, 20, "the restarted pod's two processes")
        running = spare.leftover_pids()
        assert container_pid(again) in running
    finally:
        spare.stop()
    assert not spare.leftover_pids() and not any(alive(p) for p in running)
    kube.delete(pod_path(ns, "lonely"), {"gracePeriodSeconds": 0})
    kube.delete("/api/v1/nodes/spare-0")
