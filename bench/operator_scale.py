"""Operator scale benchmark: many SGDJobs against a real kube-apiserver on loopback.

    export KUBEBUILDER_ASSETS="$(/work/shared/k8s/install.sh)"
    python -m bench.operator_scale --out DIR [--jobs 100] [--workers 8]

Starts etcd + kube-apiserver + kube-controller-manager (garbage collection) + kube-scheduler
(`devcluster.controlplane.ControlPlane(with_controllers=True)`), installs the CRD, runs `sgdjob operator
--namespace NS` as a subprocess through a counting proxy (bench.apiproxy: the operator's own API
requests, by verb and resource), creates the jobs as fast as the API takes them, and measures:
- per job, seconds from its create call returning until all its worker pods were seen by a pod
  watch (p50/p99/max), and until every job's pods exist;
- the operator's CPU seconds (utime+stime of its process tree from /proc) per phase;
- the operator's API requests per job (proxy count during the create phase / jobs), and the
  apiserver's `apiserver_request_total` delta (everyone: the operator, this bench, controllers);
- after deleting every SGDJob, seconds until no SGDJob and no pod of theirs is left (the operator
  relies on ownerReferences, so the garbage collector deletes the pods), and what the operator
  deleted itself. No pod ever runs: there is no kubelet; pods stay Pending (no nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.apiproxy import CountingProxy

GROUP, VERSION, PLURAL = "sgdjob.dev", "v1alpha1", "sgdjobs"
REPO_ROOT = Path(__file__).resolve().parents[1]
CRD = REPO_ROOT / "crds" / "sgdjobs.sgdjob.dev.yaml"
LABEL_JOB, LABEL_ROLE = "sgdjob.dev/job-name", "sgdjob.dev/role"
REQUEST_TOTAL = re.compile(r"^apiserver_request_total\{[^}]*\}\s+([0-9.eE+]+)", re.M)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its live children (one level is enough: `sgdjob` is python)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid] + [int(c) for c in _children(pid)]
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return total


def proc_memory_mib(pid: int) -> tuple[float, float]:
    """Resident memory now and at its peak (VmRSS, VmHWM), MiB, of a process and its live children."""
    now = peak = 0.0
    for p in [pid] + [int(c) for c in _children(pid)]:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        now += int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
        peak += int(fields.get("VmHWM", "0 kB").split()[0]) / 1024
    return now, peak


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def apiserver_requests(server: str, token: str) -> float:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(f"{server}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in REQUEST_TOTAL.findall(text))


def job_doc(name: str, namespace: str, workers: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SGDJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": workers,
            "nprocPerNode": 1,
            "mode": "auto",
            "training": {"model": "mlp", "dataset": "synthetic", "steps": 1000},
        },
    }


def _retry(call: Any, deadline: float) -> None:
    """Call until it succeeds (404/409: already done) or the deadline passes; a loaded API server
    answers 429/5xx now and then."""
    from kubernetes.client import ApiException

    while True:
        try:
            call()
            return
        except ApiException as err:
            if err.status in (404, 409):
                return
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class PodWatch:
    """First time each worker pod of the namespace was seen (monotonic), from a pod watch."""

    def __init__(self, core: Any, namespace: str) -> None:
        from kubernetes import watch

        self.core, self.ns = core, namespace
        self.seen: dict[str, tuple[str, float]] = {}  # pod -> (job, time)
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.watch = watch.Watch()  # type: ignore[no-untyped-call]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                for event in self.watch.stream(  # type: ignore[no-untyped-call]
                    self.core.list_namespaced_pod, self.ns, label_selector=f"{LABEL_ROLE}=worker", timeout_seconds=30
                ):
                    pod = event["object"]
                    if event["type"] == "ADDED":
                        with self.lock:
                            self.seen.setdefault(
                                pod.metadata.name, (pod.metadata.labels.get(LABEL_JOB, ""), time.monotonic())
                            )
                    if self.stop_flag.is_set():
                        return
            except Exception:  # a dropped watch is resumed; the first-seen times stay
                time.sleep(0.2)

    def per_job(self) -> dict[str, list[float]]:
        with self.lock:
            out: dict[str, list[float]] = {}
            for job, t in self.seen.values():
                out.setdefault(job, []).append(t)
            return out

    def stop(self) -> None:
        self.stop_flag.set()
        self.watch.stop()  # type: ignore[no-untyped-call]


def run(out: Path, jobs: int, workers: int, timeout_s: float, rate: float | None = None) -> dict[str, Any]:
    import urllib3
    from kubernetes import client, config

    from devcluster.controlplane import ControlPlane

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # loopback apiserver, self-signed

    out.mkdir(parents=True, exist_ok=True)
    ns = "sgdjob-scale"
    plane = ControlPlane(with_controllers=True).start()
    proxy: CountingProxy | None = None
    op: subprocess.Popen[bytes] | None = None
    try:
        proxy = CountingProxy(plane.server, plane.token).start()
        plane.kubectl("apply", "-f", str(CRD))
        plane.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
        plane.kubectl("create", "namespace", ns)
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))  # type: ignore[no-untyped-call]
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        kubeconfig = proxy.kubeconfig(out / "operator-kubeconfig")
        log = (out / "operator.log").open("wb")
        argv = [
            str(Path(sys.executable).parent / "sgdjob"),
            "operator",
            "--namespace",
            ns,
            "--kubeconfig",
            str(kubeconfig),
        ]
        op = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        time.sleep(8)  # let it log in, list and settle; its start-up CPU is reported apart
        if op.poll() is not None:
            raise RuntimeError(f"the operator exited with {op.returncode}; see {out / 'operator.log'}")
        cpu0, req0, api0 = proc_cpu_seconds(op.pid), proxy.snapshot(), apiserver_requests(plane.server, plane.token)
        rss0, _ = proc_memory_mib(op.pid)
        watcher = PodWatch(core, ns)
        watcher.thread.start()
        time.sleep(1)
        created: dict[str, float] = {}
        t0 = time.monotonic()
        for i in range(jobs):
            if rate:  # paced: job i no sooner than i / rate seconds after the first
                time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            name = f"scale-{i:03d}"
            _retry(
                lambda n=name: custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, job_doc(n, ns, workers)
                ),
                t0 + timeout_s,
            )
            created[name] = time.monotonic()
        create_calls_s = time.monotonic() - t0
        deadline = t0 + timeout_s
        reported = 0.0
        while time.monotonic() < deadline:
            seen = watcher.per_job()
            done = sum(len(seen.get(n, [])) >= workers for n in created)
            if done == len(created):
                break
            if time.monotonic() - reported > 10:
                reported = time.monotonic()
                print(
                    f"[{reported - t0:5.0f}s] {done}/{len(created)} jobs have all {workers} worker pods",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.2)
        seen = watcher.per_job()
        latencies = {n: max(seen[n]) - created[n] for n in created if len(seen.get(n, [])) >= workers}
        all_pods_s = max((max(seen[n]) for n in latencies), default=t0) - t0
        time.sleep(2)  # let in-flight status writes land before the phase's counters are read
        cpu1, req1, api1 = proc_cpu_seconds(op.pid), proxy.snapshot(), apiserver_requests(plane.server, plane.token)
        rss1, peak1 = proc_memory_mib(op.pid)
        watcher.stop()
        operator_requests = req1 - req0
        # Clean-up: delete every SGDJob; the garbage collector deletes the pods they own.
        t1 = time.monotonic()
        for name in created:  # one DELETE per job (a collection delete of 100 can outlast the API timeout)
            _retry(lambda n=name: custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, n), t1 + timeout_s)
        jobs_left = pods_left = -1
        while time.monotonic() < t1 + timeout_s:
            try:
                listed: Any = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)
                jobs_left = len(listed["items"])
                pods_left = len(core.list_namespaced_pod(ns, label_selector=LABEL_JOB).items)
            except client.ApiException:
                pass  # a slow API server: ask again
            if jobs_left == 0 and pods_left == 0:
                break
            time.sleep(0.5)
        cleanup_s = time.monotonic() - t1
        cpu2, req2 = proc_cpu_seconds(op.pid), proxy.snapshot()
        cleanup_requests = req2 - req1
        values = sorted(latencies.values())
        return {
            "jobs": jobs,
            "workers_per_job": workers,
            "jobs_with_all_pods": len(latencies),
            "create_calls_s": create_calls_s,
            "rate_limit_jobs_per_s": rate,
            "pods_exist_p50_s": percentile(values, 50),
            "pods_exist_p99_s": percentile(values, 99),
            "pods_exist_max_s": values[-1] if values else None,
            "all_pods_exist_s": all_pods_s,
            "operator_cpu_startup_s": cpu0,
            "operator_cpu_create_phase_s": cpu1 - cpu0,
            "operator_cpu_per_job_ms": (cpu1 - cpu0) * 1000 / jobs,
            "operator_rss_idle_mib": rss0,
            "operator_rss_all_jobs_mib": rss1,
            "operator_rss_peak_mib": peak1,
            "operator_rss_per_job_kib": (rss1 - rss0) * 1024 / jobs,
            "operator_requests_create_phase": sum(operator_requests.values()),
            "operator_requests_per_job": sum(operator_requests.values()) / jobs,
            "operator_requests_by_verb_resource": {f"{v} {r}": c for (v, r), c in operator_requests.most_common()},
            "apiserver_requests_create_phase_all_clients": api1 - api0,
            "cleanup_s": cleanup_s,
            "cleanup_complete": jobs_left == 0 and pods_left == 0,
            "cleanup_left": {"sgdjobs": jobs_left, "pods": pods_left},
            "operator_cpu_cleanup_phase_s": cpu2 - cpu1,
            "operator_requests_cleanup_phase": {f"{v} {r}": c for (v, r), c in cleanup_requests.most_common()},
            "operator_deleted_pods_itself": cleanup_requests.get(("delete", "pods"), 0)
            + cleanup_requests.get(("deletecollection", "pods"), 0),
            "load_average": list(os.getloadavg()),
            "cpus": os.cpu_count(),
        }
    finally:
        if op is not None and op.poll() is None:
            os.killpg(op.pid, signal.SIGTERM)
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(op.pid, signal.SIGKILL)
                op.wait(timeout=10)
        try:
            if proxy is not None:
                proxy.stop()
        finally:
            plane.stop()


def summary(doc: dict[str, Any]) -> str:
    def f(key: str, spec: str = ".2f") -> str:
        value = doc.get(key)
        return format(value, spec) if isinstance(value, int | float) else "—"

    pace = f"at most {f('rate_limit_jobs_per_s', '.1f')}/s" if doc.get("rate_limit_jobs_per_s") else "a burst"
    return (
        f"{doc['jobs']} SGDJobs x {doc['workers_per_job']} workers, created in {f('create_calls_s')}s ({pace}): "
        f"all pods of {doc['jobs_with_all_pods']} jobs exist\n"
        f"  per job, create -> all worker pods seen: p50 {f('pods_exist_p50_s')}s  p99 {f('pods_exist_p99_s')}s  "
        f"max {f('pods_exist_max_s')}s; every job's pods after {f('all_pods_exist_s')}s\n"
        f"  operator CPU: {f('operator_cpu_create_phase_s')}s for the create phase "
        f"({f('operator_cpu_per_job_ms', '.1f')} ms/job), "
        f"{f('operator_cpu_startup_s')}s start-up, {f('operator_cpu_cleanup_phase_s')}s clean-up\n"
        f"  operator memory (RSS): {f('operator_rss_idle_mib', '.0f')} MiB idle, "
        f"{f('operator_rss_all_jobs_mib', '.0f')} MiB with every job ({f('operator_rss_per_job_kib', '.0f')} KiB/job), "
        f"peak {f('operator_rss_peak_mib', '.0f')} MiB\n"
        f"  operator API requests: {f('operator_requests_per_job', '.1f')} per job "
        f"({doc['operator_requests_create_phase']} in the create phase); "
        f"apiserver_request_total delta (all clients) {f('apiserver_requests_create_phase_all_clients', '.0f')}\n"
        f"  clean-up (delete every SGDJob; pods by the garbage collector): {f('cleanup_s')}s, "
        f"complete: {doc['cleanup_complete']}, operator deleted {doc['operator_deleted_pods_itself']} pods itself\n"
        f"  machine: {doc['cpus']} CPUs, load average {doc['load_average']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.operator_scale", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="jobs created per second at most (default: as fast as the API takes them)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for pods, and for the clean-up")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the plane and the operator are stopped
    doc = run(args.out, args.jobs, args.workers, args.timeout, args.rate)
    doc["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (args.out / "operator_scale.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(summary(doc))
    return 0 if doc["jobs_with_all_pods"] == doc["jobs"] and doc["cleanup_complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
