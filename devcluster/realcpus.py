"""Slow nodes made of real resources: a CPU quota on each real node (`RealCluster(node_cpus=...)`,
`python -m devcluster up --real-nodes 3 --node-cpus 0.8,0.8,0.27`).

Where the quota goes: every container of node i lives under the cgroup `Layout.node_cgroup(i)`
(`/<prefix>-devcluster/node-<i>`), the kubelet's --cgroup-root (cgroupfs driver, cgroup v1: see
realhost.make_cgroups). A CFS quota on that cgroup caps the sum of all its pods, as a smaller machine
would: nothing sleeps, the kernel throttles the node's containers once they have used their share of
a period. The quota's arithmetic (a 10-ms period, longer only under 0.1 CPU) and its files are those
of `sgdjob run --cpu-limits` (sgdjob_operator/local/cpulimit.py), written at the top of the cpu
hierarchy, where the kubelet's absolute --cgroup-root starts.

The kubelet also advertises the limit as the node's allocatable CPU: `--system-reserved=cpu=<the rest
of the machine>`. The node's capacity stays the machine's (cAdvisor reads it, and the kubelet rewrites
its Node's capacity at every status update, so a PATCH like e2e/real.py's GPU one would not last);
allocatable = capacity - reserved is what the scheduler counts.

A limit on cgroup v1 is hierarchical in one more way: the kernel refuses a child cgroup a quota above
its parent's (EINVAL). So on a node limited to 0.27 CPU, a pod whose own CPU *limit* is above 0.27
cannot be started (the kubelet's write of the pod's quota fails); pods without CPU limits (all of the
project's) and pods with smaller limits run. cgroup v2 would cap such a pod silently instead, but the
real nodes run on v1 only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from devcluster.realhost import HostNotReady
from sgdjob_operator.local import cpulimit
from sgdjob_operator.local.cpulimit import CpuHierarchy

OPTION = "--node-cpus"
# 1 ms per 100 ms: below it the kernel's smallest quota (1 ms) needs periods over 100 ms, long stalls.
MIN_CPUS = 0.01
EXAMPLE = "e.g. --real-nodes 3 --node-cpus 0.8,0.8,0.27"


def parse(text: str) -> list[float]:
    """`0.8,0.8,0.27` -> [0.8, 0.8, 0.27]; a ValueError names --node-cpus and the bad item."""
    return cpulimit.parse_cpu_limits(text, option=OPTION)


def validate(node_cpus: Sequence[float] | None, nodes: int) -> list[float] | None:
    """One number of CPUs per node, node-0 first, each finite and >= MIN_CPUS; None (or empty): no
    limits. A ValueError names --node-cpus and the fix."""
    if not node_cpus:
        return None
    values = [float(v) for v in node_cpus]
    if len(values) != nodes:
        raise ValueError(
            f"{OPTION}: {len(values)} values for {nodes} nodes: give one number of CPUs per node, node-0 "
            f"first ({EXAMPLE})"
        )
    for i, cpus in enumerate(values):
        if not (math.isfinite(cpus) and cpus >= MIN_CPUS):
            raise ValueError(
                f"{OPTION}: {cpus:g} CPUs for node-{i}: each node needs a finite limit of at least {MIN_CPUS:g} "
                f"CPU ({EXAMPLE})"
            )
    return values


def hierarchy() -> CpuHierarchy:
    """The top of this machine's cgroup v1 cpu hierarchy (where the kubelets' --cgroup-root starts)."""
    found = cpulimit.detect(top=True)
    if found is None or found.version != 1:
        what = "no cgroup cpu controller is mounted" if found is None else "only cgroup v2 has the cpu controller"
        raise HostNotReady(
            f"{OPTION}: cannot limit the nodes' CPUs: {what}; the real nodes' cgroups are v1 (cgroupfs). "
            f"Run on a machine with a v1 cpu mount (/sys/fs/cgroup/cpu), or drop {OPTION}"
        )
    return found


def cgroup_dir(top: CpuHierarchy, path: str) -> Path:
    """An absolute cgroup path (node i's: the parent of every one of its pods' cgroups) in the cpu
    hierarchy."""
    return top.base / path.lstrip("/")


def apply(top: CpuHierarchy, node_cgroup: str, cpus: float) -> dict[str, str]:
    """Write the quota into the node's cgroup (made by realhost.make_cgroups); returns what was
    written, file by file. Idempotent: `recover_node` writes it again."""
    group = cgroup_dir(top, node_cgroup)
    files = cpulimit.quota_files(top.version, cpus)
    try:
        for name, value in files.items():  # the period first: the quota is checked against it
            (group / name).write_text(value)
    except OSError as err:
        raise HostNotReady(
            f"{OPTION}: cannot write the CPU quota of {group}: {err.strerror or err} (root is needed, and the "
            "cgroup must exist: RealCluster.start makes it)"
        ) from err
    return files


def read(top: CpuHierarchy, node_cgroup: str) -> float | None:
    """The node's CPU limit as the kernel holds it now (None: no quota)."""
    group = cgroup_dir(top, node_cgroup)
    if top.version == 1:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    else:
        text, period_text = (group / "cpu.max").read_text().split()
        if text == "max":
            return None
        quota, period = int(text), int(period_text)
    return None if quota < 0 else quota / period


def machine_cpus() -> int:
    """The machine's CPUs as the kubelet counts its capacity (cAdvisor: the online logical CPUs)."""
    return os.cpu_count() or 1


def reserved_millicpu(cpus: float, machine: int) -> int:
    """What --system-reserved holds back so that the node's allocatable CPU is `cpus` (never below 0:
    a limit above the machine's CPUs leaves allocatable at the machine's)."""
    return max(0, machine * 1000 - round(cpus * 1000))


def kubelet_flags(cpus: float | None, machine: int) -> list[str]:
    """The kubelet flags that advertise a node's CPU limit as its allocatable CPU."""
    if cpus is None:
        return []
    reserved = reserved_millicpu(cpus, machine)
    return [f"--system-reserved=cpu={reserved}m"] if reserved else []


def allocatable_millicpu(cpus: float, machine: int) -> int:
    return machine * 1000 - reserved_millicpu(cpus, machine)


def describe(node_cpus: Mapping[str, float], version: int, machine: int) -> list[str]:
    """One line per node for `up`'s summary: the quota (as `sgdjob run` describes its own) and what the
    node advertises."""
    lines = cpulimit.describe(node_cpus, version)
    return [
        f"{line}; allocatable cpu {allocatable_millicpu(cpus, machine)}m of the machine's {machine}"
        for line, cpus in zip(lines, node_cpus.values(), strict=True)
    ]
