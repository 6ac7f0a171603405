"""Slow nodes made of real resources (devcluster/realcpus.py): a 2-node real cluster with node_cpus
[1.0, 0.25] runs the same CPU-bound loop in a pod on each node at the same time, and the limited
node's pod takes at least twice as long. Also: the quota sits on the node's cgroup (every pod of the
node shares it), the kubelet advertises it as allocatable CPU, and a node that fails and boots again
with its cgroups gone (as after a reboot) gets its quota back.

The cluster is its own (prefix `sgdjcpu`, beside a session `real_cluster` if one is up): the limits
are set at start. Root only; skips saying why otherwise (fails under SGDJOB_REQUIRE_K8S=1). Times are
printed (run with -s).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest

from devcluster import realcpus, realhost
from devcluster.images import ImageBuilder
from devcluster.kube import KubeApi
from devcluster.pytest_plugin import assert_nothing_left, unavailable
from devcluster.realnodes import RealCluster
from devcluster.testing import new_namespace, phase_in, wait_for
from tests.devcluster.test_realnodes import _apply, _pod

pytestmark = pytest.mark.realnode(images=[])  # pause and python only (always imported)
PREFIX = "sgdjcpu"
NODE_CPUS = [1.0, 0.25]
# ~1-2 s of one core in CPython: long enough that the 10-ms quota periods average out.
WORK = 30_000_000
# Both loops start together, when the test creates /tmp/go in each pod (kubectl exec): they then
# share whatever else the machine runs.
BUSY = f"""
import json, os, time
print("ready", flush=True)
deadline = time.monotonic() + 300
while not os.path.exists("/tmp/go") and time.monotonic() < deadline:
    time.sleep(0.02)
wall, cpu = time.monotonic(), time.process_time()
total = 0
for i in range({WORK}):
    total += i
print(json.dumps({{"wall": time.monotonic() - wall, "cpu": time.process_time() - cpu}}), flush=True)
"""
# cgroup v1 weighs the cluster's cgroup against the machine's other work as one task (cpu.shares 1024,
# whatever the pods' nice): on a loaded machine (make test runs two sessions on 2 cores, load ~8) the
# unlimited node would get a fraction of a CPU and the test would measure that load. A large weight
# for this test's cluster lets node-0's pod have its whole CPU; node-1's quota is a cap that no weight
# lifts, so the measured ratio is the quota's.
CLUSTER_SHARES = 16 * 1024


def _millicpu(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else round(float(quantity) * 1000)


def _allocatable(kube: KubeApi, node: str) -> int:
    return _millicpu(kube.get(f"/api/v1/nodes/{node}")["status"]["allocatable"]["cpu"])


def _logs(cluster: RealCluster, ns: str, pod: str) -> str:
    return cluster.kubectl("logs", "-n", ns, pod, check=False).stdout


def _start(images: list[str]) -> RealCluster:
    reason = realhost.unavailable()
    if reason is not None:
        unavailable(f"real nodes cannot run here: {reason}")
    builder = ImageBuilder()
    built = [builder.get(name) for name in images]
    workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-"))
    cluster = RealCluster(workdir, nodes=len(NODE_CPUS), prefix=PREFIX, node_cpus=NODE_CPUS)
    try:
        return cluster.start(built)
    except realhost.HostNotReady as err:
        unavailable(f"real nodes cannot run here: {err}")


@pytest.mark.timeout(900)
def test_a_node_limited_to_a_quarter_cpu_runs_the_same_work_at_least_twice_as_long() -> None:
    t0 = time.monotonic()
    cluster = _start(["pause", "python"])
    timings: dict[str, object] = {"cluster up (s)": round(time.monotonic() - t0, 1)}
    try:
        _check(cluster, timings)
    finally:
        t0 = time.monotonic()
        problems = cluster.stop()
        timings["down (s)"] = round(time.monotonic() - t0, 1)
        print(f"\nnode CPU limits, real nodes: {json.dumps(timings)}")
    assert_nothing_left(cluster, problems)


def _check(cluster: RealCluster, timings: dict[str, object]) -> None:
    kube, lay, top = cluster.kube(), cluster.layout, realcpus.hierarchy()
    machine = realcpus.machine_cpus()
    for i, cpus in enumerate(NODE_CPUS):
        # The quota is the node cgroup's (the kubelet's --cgroup-root, parent of kubepods/...).
        assert realcpus.read(top, lay.node_cgroup(i)) == pytest.approx(cpus)
        assert _allocatable(kube, lay.node_name(i)) == realcpus.allocatable_millicpu(cpus, machine)

    ns = new_namespace(kube, "cpu")
    for i in range(lay.nodes):
        _apply(cluster, ns, _pod(f"busy-{i}", lay.node_name(i), ["python3", "-c", BUSY]))
    for i in range(lay.nodes):
        wait_for(lambda i=i: "ready" in _logs(cluster, ns, f"busy-{i}"), 180, f"busy-{i} running")  # type: ignore[misc]
    (realcpus.cgroup_dir(top, lay.cgroup_root) / "cpu.shares").write_text(str(CLUSTER_SHARES))
    for i in range(lay.nodes):
        cluster.kubectl("exec", "-n", ns, f"busy-{i}", "--", "python3", "-c", "open('/tmp/go', 'w')")
    done = {}
    for i in range(lay.nodes):
        pod = wait_for(lambda i=i: phase_in(kube, ns, f"busy-{i}", "Succeeded", "Failed"), 300, f"busy-{i} done")  # type: ignore[misc]
        logs = _logs(cluster, ns, f"busy-{i}")
        assert pod["status"]["phase"] == "Succeeded", logs
        done[i] = json.loads(logs.strip().splitlines()[-1])
    fast, slow = done[0], done[1]
    ratio = slow["wall"] / fast["wall"]
    shares = [round(d["cpu"] / d["wall"], 3) for d in (fast, slow)]
    stat = (realcpus.cgroup_dir(top, lay.node_cgroup(1)) / "cpu.stat").read_text().split()
    throttled = int(stat[stat.index("nr_throttled") + 1]) if "nr_throttled" in stat else -1
    timings.update(
        {
            "same work, node-0 at 1.0 CPU (s)": round(fast["wall"], 2),
            "same work, node-1 at 0.25 CPU (s)": round(slow["wall"], 2),
            "ratio": round(ratio, 2),
            "CPU share (cpu time / wall), node-0 / node-1": shares,
            "node-1 periods throttled": throttled,
        }
    )
    print(f"\nnode CPU limits: {json.dumps(timings)}")
    # The quota holds whatever else the machine runs: at most a quarter of a CPU (and some slack for
    # the first period); the kernel throttled node-1's pods.
    assert shares[1] <= 0.3 and throttled > 0, timings
    # node-0's pod had a whole CPU when the machine had one to give (its share says how much it got).
    assert ratio >= 2.0, timings

    # A power cut and a boot: the node's processes die, its cgroups go (as after a reboot), and
    # recover_node makes them again with the quota and the kubelet advertising it.
    t0 = time.monotonic()
    cluster.fail_node("node-1")
    wait_for(lambda: not realhost.remove_cgroups(lay.node_cgroup(1)), 30, "node-1's cgroups removed")
    assert not realcpus.cgroup_dir(top, lay.node_cgroup(1)).exists()
    cluster.recover_node("node-1")
    timings["fail + recover node-1 (s)"] = round(time.monotonic() - t0, 1)
    assert realcpus.read(top, lay.node_cgroup(1)) == pytest.approx(NODE_CPUS[1])
    assert _allocatable(kube, "node-1") == realcpus.allocatable_millicpu(NODE_CPUS[1], machine)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
