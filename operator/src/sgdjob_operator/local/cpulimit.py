"""Real slow nodes for `sgdjob run`: each limited agent (and so every trainer process it forks) runs in
a cgroup of its own with a real CPU quota (`training.emulation.cpuLimits`, `--cpu-limits`). Nothing
sleeps: the kernel throttles the group once it has used its quota in a period, so the rank is slower
in everything it does (compute, data, communication), as a smaller machine would be.

cgroup v1 (a `cpu` controller mount: cpu.cfs_quota_us / cpu.cfs_period_us) and v2 (the unified
hierarchy with the cpu controller: cpu.max) are both supported. The groups of one run live under one
parent, `sgdjob-<runner pid>-<job>/<node>`, below the runner's own cgroup, and are removed when the
run ends. Threads: a quota caps the whole group, however many threads it runs; the runner keeps one
intra-op thread per worker (OMP_NUM_THREADS=1, `local.launch.agent_env`), so a limit of 0.27 reads as
0.27 of the one core an unlimited worker uses, and threads do not fight over the quota.

Pure parts (finding the hierarchy, the quota's files, the names) are functions; `CpuLimits` writes
them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sgdjob_operator.local.launch import node_name

CGROUP_MOUNTINFO = Path("/proc/self/mountinfo")
CGROUP_SELF = Path("/proc/self/cgroup")
# A 10-ms period, not the kernel's default 100 ms: a rank at 0.25 CPU then runs 2.5 ms in every 10,
# so it is slower in every step, as a smaller machine is. With 100 ms it ran 25 ms at full speed and
# stalled 75: a short step often fitted in the 25 ms and the stall fell between steps (measured: a
# 0.25-CPU rank's compute per step 1.7-2.2x an unlimited one's, where 4x is meant).
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota
FIELD = "training.emulation.cpuLimits"
KIND = "real cgroup CPU quota (the kernel throttles the rank; no sleep)"


class CpuLimitError(RuntimeError):
    """The limits cannot be applied on this machine; the message names the field and the fix."""


@dataclass(frozen=True, slots=True)
class CpuHierarchy:
    """Where this process's cpu cgroup is: `version` 1 or 2, `base` the directory to create under."""

    version: int
    base: Path


def _mounts(mountinfo: str) -> list[tuple[Path, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, fstype, super options) of every mount line."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            out.append((Path(fields[4]), fields[3], tail[0], set(tail[2].split(","))))
    return out


def _own_path(proc_cgroup: str, version: int) -> str:
    """This process's path in the hierarchy from /proc/self/cgroup ("/" when not listed)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (version == 2 and parts[0] == "0" and parts[1] == "") or (version == 1 and "cpu" in parts[1].split(",")):
            return parts[2] or "/"
    return "/"


def _under(point: Path, mount_root: str, own: str) -> Path:
    """The mounted directory of cgroup `own`, given the mount shows the hierarchy from `mount_root`."""
    rel = os.path.relpath(own, mount_root) if own.startswith(mount_root) else "."
    return point if rel == "." else point / rel


def find_cpu_hierarchy(
    mountinfo: str, proc_cgroup: str, v2_controllers: str | None = None, *, top: bool = False
) -> CpuHierarchy | None:
    """The cgroup hierarchy that can limit CPU: a v1 mount with the `cpu` controller first, else the
    v2 unified mount when its cgroup.controllers (`v2_controllers`) lists cpu. None when neither.
    `base` is this process's own cgroup, or with `top` the mount point itself: where absolute cgroup
    paths start, such as a kubelet's --cgroup-root (devcluster's real nodes)."""
    mounts = _mounts(mountinfo)
    for point, root, fstype, options in mounts:
        if fstype == "cgroup" and "cpu" in options:
            return CpuHierarchy(1, point if top else _under(point, root, _own_path(proc_cgroup, 1)))
    for point, root, fstype, _ in mounts:
        if fstype == "cgroup2" and v2_controllers is not None and "cpu" in v2_controllers.split():
            return CpuHierarchy(2, point if top else _under(point, root, _own_path(proc_cgroup, 2)))
    return None


def period_us(cpus: float) -> int:
    """The CFS period for a limit of `cpus`: PERIOD_US, longer only where the quota would fall below
    the kernel's smallest (under 0.1 CPU)."""
    if not cpus > 0:
        raise ValueError(f"{FIELD}: a CPU limit must be > 0, got {cpus}")
    return max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpus))


def quota_us(cpus: float) -> int:
    """Microseconds of CPU per period for a limit of `cpus` (0.27 -> 2700 of 10000)."""
    return max(MIN_QUOTA_US, round(cpus * period_us(cpus)))


def quota_files(version: int, cpus: float) -> dict[str, str]:
    """What to write into the agent's group, file by file, in this order."""
    quota, period = quota_us(cpus), period_us(cpus)
    if version == 1:
        return {"cpu.cfs_period_us": str(period), "cpu.cfs_quota_us": str(quota)}
    return {"cpu.max": f"{quota} {period}"}


def run_group_name(job: str, pid: int) -> str:
    """The parent group of one run: the runner's pid first, so a leftover of a killed runner is known."""
    return f"sgdjob-{pid}-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)[:64]}"


def stale_run_groups(names: Iterable[str], alive: Callable[[int], bool]) -> list[str]:
    """Run groups left by a runner that is gone (killed with SIGKILL before it could remove them)."""
    out = []
    for name in names:
        found = re.fullmatch(r"sgdjob-(\d+)-.*", name)
        if found and not alive(int(found.group(1))):
            out.append(name)
    return out


def limits_by_node(limits: Sequence[float]) -> dict[str, float]:
    """The i-th limit belongs to agent local-i (the nodes `sgdjob run` starts with)."""
    return {node_name(i): float(v) for i, v in enumerate(limits)}


def describe(limits: Mapping[str, float], version: int) -> list[str]:
    """One line per limited node for the live view and the report: what the limit is, honestly."""
    files = "cpu.cfs_quota_us/cpu.cfs_period_us" if version == 1 else "cpu.max"
    return [
        f"{node} limited to {cpus:g} CPU: a real cgroup v{version} CPU quota "
        f"({quota_us(cpus)} us per {period_us(cpus)} us, {files}), not an emulated sleep"
        for node, cpus in limits.items()
    ]


def parse_cpu_limits(text: str, option: str = "--cpu-limits") -> list[float]:
    """`--cpu-limits 0.8,0.8,0.27` -> [0.8, 0.8, 0.27]; a ValueError names `option` and the bad item."""
    out = []
    for item in text.split(","):
        try:
            value = float(item.strip())
        except ValueError:
            raise ValueError(f"{option}: {item.strip()!r} is not a number of CPUs (e.g. 0.8,0.8,0.27)") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{option}: {value:g} must be a finite number > 0 of CPUs (e.g. 0.8,0.8,0.27)")
        out.append(value)
    return out


def _fix(problem: str) -> str:
    return (
        f"{FIELD} (or --cpu-limits): cannot apply a real CPU quota: {problem}. Run `sgdjob run` as root on a "
        "machine with the cgroup cpu controller (v1 cpu mount or v2 cpu.max), or drop the CPU limits "
        "(emulation.slowdowns emulate a slow rank with a sleep instead)"
    )


@dataclass(slots=True)
class CpuLimits:
    """The cgroups of one run. `create` makes and configures them (raising CpuLimitError with the fix),
    `procs_file(node)` is where an agent writes its pid, `remove` deletes them."""

    hierarchy: CpuHierarchy
    parent: Path
    limits: dict[str, float]
    groups: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, job: str, limits: Mapping[str, float], hierarchy: CpuHierarchy | None = None) -> CpuLimits:
        if hierarchy is None:
            hierarchy = detect()
        if hierarchy is None:
            raise CpuLimitError(_fix("no cgroup hierarchy with the cpu controller is mounted"))
        made = cls(hierarchy, hierarchy.base / run_group_name(job, os.getpid()), dict(limits))
        _remove_stale(hierarchy.base)
        try:
            made.parent.mkdir()
            if hierarchy.version == 2:  # children may use the cpu controller only if the parent hands it down
                (made.parent / "cgroup.subtree_control").write_text("+cpu")
            for node, cpus in limits.items():
                group = made.parent / node
                group.mkdir()
                made.groups[node] = group
                for name, value in quota_files(hierarchy.version, cpus).items():
                    (group / name).write_text(value)
        except OSError as err:
            made.remove(wait_s=0.0)
            raise CpuLimitError(_fix(f"{err.filename or made.parent}: {err.strerror or err}")) from err
        return made

    def procs_file(self, node: str) -> Path | None:
        group = self.groups.get(node)
        return group / "cgroup.procs" if group is not None else None

    def remove(self, wait_s: float = 5.0) -> list[str]:
        """Delete the groups (children first); a group a dying process still holds is retried for up
        to `wait_s`. Returns the groups left behind (empty when all are gone)."""
        deadline = time.monotonic() + wait_s
        pending = [*self.groups.values(), self.parent]
        while True:
            left = []
            for group in pending:
                try:
                    group.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(group)
            if not left or time.monotonic() >= deadline:
                return [str(g) for g in left]
            pending = left
            time.sleep(0.1)

    def report(self) -> dict[str, object]:
        return {
            "kind": KIND,
            "cgroup_version": self.hierarchy.version,
            "by_node": {
                node: {"cpus": cpus, "quota_us": quota_us(cpus), "period_us": period_us(cpus)}
                for node, cpus in self.limits.items()
            },
        }


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _remove_stale(base: Path) -> None:
    """Delete the empty groups of runners that are gone; a group still holding a process stays."""
    with contextlib.suppress(OSError):
        for name in stale_run_groups((p.name for p in base.iterdir() if p.is_dir()), _pid_alive):
            parent = base / name
            with contextlib.suppress(OSError):
                for child in parent.iterdir():
                    if child.is_dir():
                        child.rmdir()
                parent.rmdir()


def detect(top: bool = False) -> CpuHierarchy | None:
    """This machine's cpu hierarchy, from /proc (None when it has none); `top`: its mount point rather
    than this process's own cgroup (find_cpu_hierarchy)."""
    try:
        mountinfo, own = CGROUP_MOUNTINFO.read_text(), CGROUP_SELF.read_text()
    except OSError:
        return None
    controllers = None
    for point, _, fstype, _ in _mounts(mountinfo):
        if fstype == "cgroup2":
            with contextlib.suppress(OSError):
                controllers = (point / "cgroup.controllers").read_text()
    return find_cpu_hierarchy(mountinfo, own, controllers, top=top)


def join_cgroup(procs_file: str) -> None:
    """Move the calling process into a cgroup (in a child between fork and exec, so its own children
    are born inside): low-level writes only, as little as can be done there."""
    fd = os.open(procs_file, os.O_WRONLY)
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)


def limits_for(job: str, cpu_limits: Sequence[float] | None) -> CpuLimits | None:
    """The run's cgroups when the spec asks for CPU limits (None when it does not)."""
    return CpuLimits.create(job, limits_by_node(cpu_limits)) if cpu_limits else None
