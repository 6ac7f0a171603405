"""The chaos suite's observations of a job and its pods on the real-node cluster (e2e/test_chaos.py):
its step, outcome and live worker pods, the restart records its workers log and the recovery timed from
them, the moments a fault's effects happen (watch_marks), the duplicate pods PodWatch counts, the nodes
its pods and the operator run on, and a job placed on one node before its fault (start_gathered); `record`
keeps each case's figures for the table printed at the end of the module (results_table)."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

from devcluster.testing import Obj, wait_for
from e2e.helpers import job_status, worker_pods
from e2e.real import OPERATOR_LABELS, OPERATOR_NS, RealEnv

JOB = "chaos"
INTERVAL = 20  # checkpoint.intervalSteps
START_TIMEOUT = 240.0
RECOVER_TIMEOUT = 240.0
RESTART_RE = re.compile(r"restart: (\d+) steps lost \(reached (\d+), resumed at (\d+)\)")


class PodWatch:
    """Polls a job's worker pods in the background: the most live pods per worker index and in all, and
    every worker log seen (the kubelet removes a deleted pod's logs; each life is kept here)."""

    def __init__(self, env: RealEnv, job: str) -> None:
        self.env, self.kube, self.ns, self.job = env, env.kube, env.ns, job
        self.per_index = 0
        self.total = 0
        self.logs: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                pods = worker_pods(self.kube, self.ns, self.job)
            except Exception:  # the API server may be restarting (case d)
                continue
            live = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
            counts: dict[str, int] = {}
            for pod in live:
                index = str(pod["metadata"]["labels"].get("sgdjob.dev/replica-index"))
                counts[index] = counts.get(index, 0) + 1
            self.per_index = max(self.per_index, *counts.values(), 0)
            self.total = max(self.total, len(live))
            self.logs.update(self.env.job_logs(self.job))


# The operator's Event for a failure it counts against backoffLimit (k8s/failures.classify).
COUNTED_RE = re.compile(r"worker pod (\S+) failed \(.*\); see its log")


def counted_failures(logs: dict[str, str], events: list[str], lines: int = 40) -> str:
    """The last `lines` of each of `logs` (PodWatch.logs) of a pod whose failure the operator counted, for an
    assertion's message: the kubelet's logs go with the cluster, and a flake then leaves only its name."""
    names = {m.group(1) for event in events if (m := COUNTED_RE.search(event))}
    tails = [
        f"--- {path}\n" + "\n".join(text.splitlines()[-lines:])
        for path, text in sorted(logs.items())
        if any(f"_{name}_" in path for name in names)  # .../log/pods/<namespace>_<pod>_<uid>/<container>/N.log
    ]
    return "\n".join(tails) or f"(no kept log of {sorted(names) or 'a counted failure'})"


STOP_WORDS = ("restart:", "checkpoint", "stopped", "resumed", "SIGTERM", "async at step", "sync at step")


def stop_lines(logs: dict[str, str], lines: int = 60) -> str:
    """Each kept log's lines about stops, checkpoints and resumes (the last `lines` of them), for an
    assertion on steps lost: which step each life stopped at and which checkpoint the next one loaded."""
    kept = [
        f"{path.split('/log/pods/')[-1]}: {line}"
        for path, text in sorted(logs.items())
        for line in text.splitlines()
        if any(word in line for word in STOP_WORDS)
    ]
    return "\n".join(kept[-lines:]) or "(no kept log says)"


RESULTS: dict[str, dict[str, Any]] = {}


def record(case: str, outcome: str, watch: PodWatch, recovery_s: float | None, lost: int | None) -> None:
    RESULTS[case] = {
        "outcome": outcome,
        "recovery_s": None if recovery_s is None else round(recovery_s, 1),
        "lost_steps": lost,
        "dup_pods": watch.per_index - 1 if watch.per_index else 0,
        "max_pods": watch.total,
    }


def results_table() -> str:
    """The figures `record` kept, a line per case: the table printed at the end of the module."""
    lines = [f"{'case':<34} {'outcome':<34} {'recovery_s':>10} {'lost_steps':>10} {'dup_pods':>8} {'max_pods':>8}"]
    for case, r in RESULTS.items():
        lines.append(
            f"{case:<34} {r['outcome']:<34} {r['recovery_s']!s:>10} {r['lost_steps']!s:>10} "
            f"{r['dup_pods']:>8} {r['max_pods']:>8}"
        )
    return "\n".join(lines)


def step(e: RealEnv, job: str = JOB) -> int:
    try:
        return int(job_status(e.kube, e.ns, job).get("step") or 0)
    except Exception:  # the API server may be restarting (case d)
        return 0


def outcome(e: RealEnv, job: str = JOB) -> str:
    st = job_status(e.kube, e.ns, job)
    failed = [c for c in st.get("conditions") or [] if c["type"] == st.get("phase") and c.get("reason")]
    return f"{st.get('phase')}" + (f" ({failed[0]['reason']})" if failed else "")


def live(e: RealEnv, job: str = JOB) -> list[Obj]:
    return [p for p in worker_pods(e.kube, e.ns, job) if not p["metadata"].get("deletionTimestamp")]


def uids(pods: list[Obj]) -> dict[str, str]:
    return {str(p["metadata"]["name"]): str(p["metadata"]["uid"]) for p in pods}


def full_world(e: RealEnv, n: int = 3) -> list[Obj] | None:
    pods = live(e)
    ok = len(pods) == n and all(p["status"].get("phase") == "Running" for p in pods)
    return pods if ok and job_status(e.kube, e.ns, JOB).get("readyReplicas") == n else None


def restarts(e: RealEnv, job: str = JOB) -> list[tuple[int, int, int]]:
    """Every restart record (lost, reached, resumed-at) in the worker logs the nodes hold so far."""
    found: list[tuple[int, int, int]] = []
    for text in e.job_logs(job).values():
        found += [(int(a), int(b), int(c)) for a, b, c in RESTART_RE.findall(text)]
    return found


def recovered(e: RealEnv, before: list[tuple[int, int, int]], t0: float, job: str = JOB) -> tuple[float, int]:
    """Waits for a new restart record and then training past the step it had reached; returns the
    seconds from `t0` and the lost steps."""
    fresh = wait_for(lambda: [r for r in restarts(e, job) if r not in before], RECOVER_TIMEOUT, "a restart record")
    lost, reached, _ = fresh[0]
    wait_for(lambda: step(e, job) > reached, RECOVER_TIMEOUT, f"training past step {reached}")
    return time.monotonic() - t0, lost


def spared_worker(e: RealEnv, pods: list[Obj]) -> Obj:
    """A worker whose node holds neither the rendezvous store nor, where it can be, the operator: the
    fault is meant for a worker, not the store every rank needs (or the operator's restart)."""
    rdzv = e.kube.get(f"/api/v1/namespaces/{e.ns}/pods/{JOB}-rdzv")["spec"].get("nodeName")
    candidates = [p for p in reversed(pods) if p["spec"]["nodeName"] != rdzv]
    operator = e.operator_node()
    return next((p for p in candidates if p["spec"]["nodeName"] != operator), candidates[0])


def ready_for_fault(e: RealEnv) -> tuple[list[Obj], int]:
    pods = wait_for(lambda: full_world(e), RECOVER_TIMEOUT, "3 running, ready workers")
    at = step(e)
    wait_for(lambda: step(e) > at + INTERVAL, 120, "a fresh checkpoint and steps")
    return pods, step(e)


def pod_node(e: RealEnv, name: str) -> str | None:
    pod = e.kube.get_or_none(f"/api/v1/namespaces/{e.ns}/pods/{name}")
    return None if pod is None else pod["spec"].get("nodeName")


def gathered_on(e: RealEnv, job: str, node: str) -> bool:
    """The job's rendezvous store and worker-0 both running on `node`."""
    pods = {p["metadata"]["name"]: p for p in e.kube.get(f"/api/v1/namespaces/{e.ns}/pods")["items"]}
    wanted = [pods.get(f"{job}-rdzv"), pods.get(f"{job}-worker-0")]
    return all(p and p["spec"].get("nodeName") == node and p["status"].get("phase") == "Running" for p in wanted)


def finished(e: RealEnv, job: str) -> Obj | None:
    st = job_status(e.kube, e.ns, job)
    return st if st.get("phase") in ("Succeeded", "Failed") else None


def watch_marks(marks: dict[str, Any], t0: float, timeout: float) -> dict[str, tuple[float, Any]]:
    """Polls each check in a thread of its own; the returned dict fills in, as each turns truthy, with
    (seconds since `t0`, the check's value)."""
    seen: dict[str, tuple[float, Any]] = {}

    def poll(name: str, check: Any) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = check()
            except Exception:  # the API server answers slowly while a node's pods are torn down
                value = None
            if value:
                seen[name] = (round(time.monotonic() - t0, 1), value)
                return
            time.sleep(0.5)

    for name, check in marks.items():
        threading.Thread(target=poll, args=(name, check), daemon=True).start()
    return seen


def start_gathered(env: RealEnv, job: str, manifest: Obj, node: str, min_replicas: int, workers: int = 3) -> None:
    """Starts `manifest` (1 replica) with its rendezvous store and worker-0 on `node`, as bad luck would
    place them (they start while every other node is cordoned), then grows it to `workers` over the
    other nodes with `min_replicas`; returns after a fresh checkpoint in that world."""
    others = [n for n in env.cluster.node_names() if n != node]
    for other in others:
        env.kubectl("cordon", other)
    try:
        env.apply(json.dumps(manifest))
        wait_for(lambda: gathered_on(env, job, node), START_TIMEOUT, f"store and worker-0 running on {node}")
    finally:
        for other in others:
            env.kubectl("uncordon", other)
    grow = json.dumps({"spec": {"replicas": workers, "minReplicas": min_replicas}})
    env.kubectl("patch", "sgdjob", job, "-n", env.ns, "--type=merge", "-p", grow)
    wait_for(
        lambda: len(live(env, job)) == workers and job_status(env.kube, env.ns, job).get("readyReplicas") == workers,
        START_TIMEOUT,
        f"{workers} ready workers",
    )
    at = step(env, job)
    wait_for(lambda: step(env, job) > at + 2 * INTERVAL, 180, f"steps and a fresh checkpoint in a world of {workers}")
    assert gathered_on(env, job, node) and env.operator_node() == node, "still gathered on one node"


def node_ready(e: RealEnv, node: str) -> bool:
    conds = e.kube.get(f"/api/v1/nodes/{node}")["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def standby_again(e: RealEnv, lost: list[str]) -> str | None:
    """The node of a second ready operator replica off the `lost` nodes (the chart's
    nodeLostTolerationSeconds evicts a lost node's replica, and its Deployment starts one elsewhere)."""
    pods = [p for p in e.operator.pods() if p["spec"].get("nodeName") not in lost]
    return pods[-1]["spec"]["nodeName"] if len(pods) >= 2 and e.operator.pod() in pods else None


# Node marked lost (~40 s) + the chart's 30-s toleration + a start: 75 s after the loss on an idle
# machine; the wait starts once the job recovered from that loss (~45 s after it).
EVICTION_S = 150.0


def standby_back(e: RealEnv, lost: list[str]) -> tuple[str, str]:
    """Wait for an operator replica off the `lost` nodes: the node it runs on, and how it came back.
    Kubernetes evicts the lost node's replica (the chart's toleration) within EVICTION_S; where it
    did not, the replica is force-deleted as an admin does for a pod on a node that never returns
    (`kubectl delete pod --force`), and its Deployment starts it elsewhere. The fallback exists
    because in a clean CI run (full load, some minutes after case d's API-server restart) this
    cluster's controller-manager marked the node NotReady but evicted nothing from it in 5 minutes;
    the timeline shows which way the replica came back."""
    try:
        return wait_for(lambda: standby_again(e, lost), EVICTION_S, "eviction"), "evicted by Kubernetes"
    except AssertionError:
        pods = e.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods", labelSelector=OPERATOR_LABELS)["items"]
        for pod in pods:
            if pod["spec"].get("nodeName") in lost:
                e.kubectl("delete", "pod", pod["metadata"]["name"], "-n", OPERATOR_NS, "--force", "--grace-period=0")
    try:
        at = wait_for(lambda: standby_again(e, lost), 120, "an operator replica off the lost node")
    except AssertionError as missing:
        raise AssertionError(f"{missing}: {operator_replicas(e)}") from None
    return at, f"not evicted in {EVICTION_S:.0f} s: force-deleted"


def operator_replicas(e: RealEnv) -> str:
    """Every operator pod (node, phase, ready, deleting) and every node's taints: what a wait for a
    replica off a lost node says when it times out, since the pods and Events go with the cluster."""
    pods = e.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods", labelSelector=OPERATOR_LABELS)["items"]
    lines = []
    for pod in pods:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
        lines.append(
            f"{pod['metadata']['name']} on {pod['spec'].get('nodeName')}: {pod['status'].get('phase')}, "
            f"ready {ready}, deleting {bool(pod['metadata'].get('deletionTimestamp'))}"
        )
    for node in e.kube.get("/api/v1/nodes")["items"]:
        taints = [f"{t['key']}:{t['effect']}" for t in node["spec"].get("taints", [])]
        lines.append(f"node {node['metadata']['name']}: taints {taints}")
    return "; ".join(lines)
