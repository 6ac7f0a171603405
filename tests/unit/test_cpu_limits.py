"""Real CPU limits for `sgdjob run` (local.cpulimit): the pure parts, the spec's validation and the
clear error where cgroups cannot be written. The real quota is measured in tests/local/test_cpu_quota_runs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sgdjob_operator.api.validation import SpecError, validate_job
from sgdjob_operator.cli.run import with_cpu_limits
from sgdjob_operator.local.cpulimit import (
    CpuHierarchy,
    CpuLimitError,
    CpuLimits,
    describe,
    find_cpu_hierarchy,
    limits_by_node,
    parse_cpu_limits,
    period_us,
    quota_files,
    quota_us,
    run_group_name,
    stale_run_groups,
)

V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_SELF = "2:cpuacct:/\n1:cpu:/jobs/a\n0::/\n"
V2_MOUNTINFO = "30 24 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V2_SELF = "0::/user.slice/session-1.scope\n"


def test_v1_cpu_mount_wins_and_the_group_goes_under_the_runners_own_cgroup() -> None:
    found = find_cpu_hierarchy(V1_MOUNTINFO, V1_SELF, "memory pids")
    assert found == CpuHierarchy(1, Path("/sys/fs/cgroup/cpu/jobs/a"))


def test_v2_needs_the_cpu_controller() -> None:
    assert find_cpu_hierarchy(V2_MOUNTINFO, V2_SELF, "cpuset cpu io memory pids") == CpuHierarchy(
        2, Path("/sys/fs/cgroup/user.slice/session-1.scope")
    )
    assert find_cpu_hierarchy(V2_MOUNTINFO, V2_SELF, "memory pids") is None
    assert find_cpu_hierarchy("", "", None) is None


def test_a_mount_showing_a_subtree_maps_the_own_path_inside_it() -> None:
    container = "40 31 0:29 /docker/abc /sys/fs/cgroup/cpu ro - cgroup cgroup rw,cpu,cpuacct\n"
    found = find_cpu_hierarchy(container, "3:cpu,cpuacct:/docker/abc\n", None)
    assert found == CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))


def test_top_is_the_mount_point_where_absolute_cgroup_paths_start() -> None:
    # devcluster's real nodes write under a kubelet's --cgroup-root, an absolute path.
    assert find_cpu_hierarchy(V1_MOUNTINFO, V1_SELF, None, top=True) == CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))
    found = find_cpu_hierarchy(V2_MOUNTINFO, V2_SELF, "cpu memory", top=True)
    assert found == CpuHierarchy(2, Path("/sys/fs/cgroup"))


def test_quota_per_period_and_files_per_version() -> None:
    assert quota_us(0.27) == 2_700 and quota_us(2.0) == 20_000 and period_us(0.27) == 10_000
    # Under 0.1 CPU the period grows so the quota stays at the kernel's smallest, 1 ms.
    assert (quota_us(0.05), period_us(0.05)) == (1_000, 20_000) and (quota_us(0.01), period_us(0.01)) == (
        1_000,
        100_000,
    )
    with pytest.raises(ValueError, match="cpuLimits"):
        quota_us(0.0)
    assert quota_files(1, 0.8) == {"cpu.cfs_period_us": "10000", "cpu.cfs_quota_us": "8000"}
    assert quota_files(2, 0.8) == {"cpu.max": "8000 10000"}


def test_names_and_description_say_what_the_limit_is() -> None:
    assert run_group_name("my job/x", 42) == "sgdjob-42-my_job_x"
    assert limits_by_node([0.8, 0.27]) == {"local-0": 0.8, "local-1": 0.27}
    (line,) = describe({"local-2": 0.27}, 1)
    assert "local-2" in line and "0.27 CPU" in line and "real cgroup v1 CPU quota" in line and "not an emulated" in line


def test_parse_cpu_limits_names_the_option() -> None:
    assert parse_cpu_limits("0.8, 0.8,0.27") == [0.8, 0.8, 0.27]
    for bad in ("0.8,abc", "0.8,0", "-1", "inf"):
        with pytest.raises(ValueError, match="--cpu-limits"):
            parse_cpu_limits(bad)
    with pytest.raises(ValueError, match=r"^--node-cpus: 'x' is not"):
        parse_cpu_limits("x", option="--node-cpus")


def job_doc(replicas: int = 3, **emulation: Any) -> dict[str, Any]:
    training: dict[str, Any] = {"steps": 5}
    if emulation:
        training["emulation"] = emulation
    return {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "j"},
            "spec": {"replicas": replicas, "training": training}}  # fmt: skip


def test_validation_names_the_field_for_a_wrong_count_or_a_bad_value() -> None:
    ok = validate_job(job_doc(computeSeconds=0, cpuLimits=[0.8, 0.8, 0.27]))
    assert ok.spec.training.emulation is not None and ok.spec.training.emulation.cpu_limits == [0.8, 0.8, 0.27]
    with pytest.raises(SpecError) as err:
        validate_job(job_doc(cpuLimits=[0.8, 0.27]))
    assert err.value.problems == [
        "spec.training.emulation.cpuLimits: gives 2 CPU limits for 3 replicas: give one limit (in CPUs) per "
        "worker, local-0 first"
    ]
    for bad in (0, -0.5):
        with pytest.raises(SpecError) as err:
            validate_job(job_doc(cpuLimits=[0.8, bad, 0.27]))
        assert err.value.problems[0].startswith("spec.training.emulation.cpuLimits[1]:")


def test_cli_override_sets_the_limits_without_a_sleep_and_keeps_the_files_emulation() -> None:
    plain = with_cpu_limits(validate_job(job_doc()), [1.0, 1.0, 0.3])
    emulation = plain.spec.training.emulation
    assert emulation is not None and emulation.cpu_limits == [1.0, 1.0, 0.3] and emulation.compute_seconds == 0.0
    slept = with_cpu_limits(validate_job(job_doc(computeSeconds=0.02, jitter=0.1)), [1.0, 1.0, 0.3])
    assert slept.spec.training.emulation is not None and slept.spec.training.emulation.compute_seconds == 0.02
    with pytest.raises(SpecError) as err:
        with_cpu_limits(validate_job(job_doc()), [1.0])
    assert err.value.problems[0].startswith("--cpu-limits: spec.training.emulation.cpuLimits: gives 1 CPU limits")


def test_unwritable_cgroups_fail_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    missing = CpuHierarchy(1, tmp_path / "no-such-cgroup-mount")
    with pytest.raises(CpuLimitError) as err:
        CpuLimits.create("j", {"local-0": 0.5}, missing)
    text = str(err.value)
    assert "training.emulation.cpuLimits" in text and "--cpu-limits" in text and "root" in text
    assert str(missing.base) in text


def test_groups_of_a_runner_that_is_gone_are_found_for_removal() -> None:
    names = ["sgdjob-10-a", "sgdjob-11-b", "user.slice", "sgdjob-x-c"]
    assert stale_run_groups(names, lambda pid: pid == 11) == ["sgdjob-10-a"]
