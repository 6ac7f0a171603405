"""Per-node CPU limits of the real-node cluster (devcluster/realcpus.py, `up --node-cpus`): parsing and
validation, the files written into a node's cgroup (a fake cgroup tree under tmp_path), the kubelet's
allocatable flag, a recover that finds the cgroup gone, and the CLI's refusals. No root, nothing
started; the real quota is measured in tests/devcluster/test_realnodes_cpus.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devcluster import cluster as cli
from devcluster import realcli, realconf, realcpus, realhost, realnodes
from devcluster.realhost import HostNotReady
from devcluster.realnodes import RealCluster
from sgdjob_operator.local import cpulimit
from sgdjob_operator.local.cpulimit import CpuHierarchy


def test_parse_and_validate_name_the_option_and_the_fix() -> None:
    assert realcpus.parse("0.8, 0.8,0.27") == [0.8, 0.8, 0.27]
    for bad in ("0.8,abc", "0.8,0", "-1", "inf"):
        with pytest.raises(ValueError, match="--node-cpus"):
            realcpus.parse(bad)
    assert realcpus.validate(None, 3) is None and realcpus.validate([], 3) is None
    assert realcpus.validate([1, 0.01], 2) == [1.0, 0.01]
    with pytest.raises(ValueError) as err:
        realcpus.validate([0.8, 0.27], 3)
    assert str(err.value) == (
        "--node-cpus: 2 values for 3 nodes: give one number of CPUs per node, node-0 first "
        "(e.g. --real-nodes 3 --node-cpus 0.8,0.8,0.27)"
    )
    for low in (0.005, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"--node-cpus: .* CPUs for node-1: .* at least 0.01 CPU"):
            realcpus.validate([1.0, low], 2)


def test_the_cluster_refuses_a_wrong_count_and_keeps_its_limits_in_its_state(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--node-cpus: 1 values for 2 nodes"):
        RealCluster(tmp_path, nodes=2, node_cpus=[0.5])
    made = RealCluster(tmp_path, nodes=2, prefix="sgdjunit", node_cpus=[1, 0.25])
    made._save()
    assert RealCluster.load(tmp_path).node_cpus == [1.0, 0.25]
    RealCluster(tmp_path, nodes=2, prefix="sgdjunit")._save()
    assert RealCluster.load(tmp_path).node_cpus is None


def _node(top: Path, path: str) -> Path:
    node = top / path.lstrip("/")
    node.mkdir(parents=True, exist_ok=True)
    return node


def test_the_quota_goes_into_the_node_cgroup_in_either_version(tmp_path: Path) -> None:
    v1 = CpuHierarchy(1, tmp_path / "cpu")
    node = _node(v1.base, "/sgdjob-devcluster/node-2")
    assert realcpus.cgroup_dir(v1, "/sgdjob-devcluster/node-2") == node
    written = realcpus.apply(v1, "/sgdjob-devcluster/node-2", 0.27)
    assert written == {"cpu.cfs_period_us": "10000", "cpu.cfs_quota_us": "2700"}
    assert {f.name: f.read_text() for f in node.iterdir()} == written
    assert realcpus.read(v1, "/sgdjob-devcluster/node-2") == pytest.approx(0.27)
    (node / "cpu.cfs_quota_us").write_text("-1\n")  # as the kernel shows no quota
    assert realcpus.read(v1, "/sgdjob-devcluster/node-2") is None
    # Under 0.1 CPU the period grows (the kernel's smallest quota is 1 ms), as for `sgdjob run`.
    assert realcpus.apply(v1, "/sgdjob-devcluster/node-2", 0.01) == {
        "cpu.cfs_period_us": "100000",
        "cpu.cfs_quota_us": "1000",
    }

    v2 = CpuHierarchy(2, tmp_path / "unified")
    _node(v2.base, "/x/node-0")
    assert realcpus.apply(v2, "/x/node-0", 0.8) == {"cpu.max": "8000 10000"}
    assert realcpus.read(v2, "/x/node-0") == pytest.approx(0.8)
    (v2.base / "x" / "node-0" / "cpu.max").write_text("max 100000\n")
    assert realcpus.read(v2, "/x/node-0") is None


def test_a_missing_cgroup_fails_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(HostNotReady, match=r"--node-cpus: cannot write the CPU quota of .*node-0"):
        realcpus.apply(CpuHierarchy(1, tmp_path), "/sgdjob-devcluster/node-0", 0.5)


def test_only_a_v1_cpu_hierarchy_will_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for found, words in ((None, "no cgroup cpu controller"), (CpuHierarchy(2, tmp_path), "only cgroup v2")):
        monkeypatch.setattr(cpulimit, "detect", lambda top=False, found=found: found)
        with pytest.raises(HostNotReady, match=f"--node-cpus: cannot limit the nodes' CPUs: {words}.*drop --node-cpus"):
            realcpus.hierarchy()
    monkeypatch.setattr(cpulimit, "detect", lambda top=False: CpuHierarchy(1, tmp_path) if top else None)
    assert realcpus.hierarchy() == CpuHierarchy(1, tmp_path)


def test_the_kubelet_advertises_the_limit_as_allocatable(tmp_path: Path) -> None:
    assert realcpus.kubelet_flags(0.27, 2) == ["--system-reserved=cpu=1730m"]
    assert realcpus.allocatable_millicpu(0.27, 2) == 270
    assert realcpus.kubelet_flags(1.0, 16) == ["--system-reserved=cpu=15000m"]
    # The whole machine or more: nothing to reserve (allocatable stays the machine's).
    assert realcpus.kubelet_flags(2.0, 2) == realcpus.kubelet_flags(4.0, 2) == realcpus.kubelet_flags(None, 2) == []
    assert realcpus.allocatable_millicpu(4.0, 2) == 2000
    argv = realconf.kubelet_argv(Path("/b"), realconf.Layout(tmp_path, 2), 1, realcpus.kubelet_flags(0.25, 2))
    assert "--system-reserved=cpu=1750m" in argv and argv[-1] == "--v=1"
    assert not [a for a in realconf.kubelet_argv(Path("/b"), realconf.Layout(tmp_path, 2), 1) if "reserved" in a]
    (line,) = realcpus.describe({"node-2": 0.27}, 1, 2)
    assert line.startswith("node-2 limited to 0.27 CPU: a real cgroup v1 CPU quota (2700 us per 10000 us")
    assert line.endswith("; allocatable cpu 270m of the machine's 2")


@pytest.fixture
def fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CpuHierarchy:
    """A cpu hierarchy under tmp_path: make_cgroups creates there, the machine has 2 CPUs."""
    top = CpuHierarchy(1, tmp_path / "cgroup" / "cpu")
    monkeypatch.setattr(realcpus, "hierarchy", lambda: top)
    monkeypatch.setattr(realcpus, "machine_cpus", lambda: 2)
    monkeypatch.setattr(realhost, "make_cgroups", lambda paths: [_node(top.base, p) for p in paths])
    return top


def test_recover_writes_the_quota_again_into_a_cgroup_made_anew(
    fake_host: CpuHierarchy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = RealCluster(tmp_path / "work", nodes=2, prefix="sgdjunit", node_cpus=[1.0, 0.25])
    lay = made.layout
    realhost.make_cgroups([lay.node_cgroup(i) for i in range(2)])
    for i in range(2):
        made._limit_cpus(i)  # as start() does, before any kubelet runs
    assert [realcpus.read(fake_host, lay.node_cgroup(i)) for i in range(2)] == [1.0, 0.25]

    spawned: dict[str, list[str]] = {}

    def spawn(name: str, argv: list[str], prefix: list[str]) -> int:
        spawned[name] = argv
        return 0

    monkeypatch.setattr(made.daemons, "spawn", spawn)
    monkeypatch.setattr(made.daemons, "wait", lambda check, timeout, what: None)
    monkeypatch.setattr(realnodes, "assets_dir", lambda: Path("/b"))
    made.daemons.pids["node-1.holder"] = 1
    shutil.rmtree(realcpus.cgroup_dir(fake_host, lay.node_cgroup(1)))  # a reboot: the node's cgroups are gone
    made.recover_node("node-1")
    assert realcpus.read(fake_host, lay.node_cgroup(1)) == pytest.approx(0.25)
    assert set(spawned) == {"node-1.containerd", "node-1.kubelet", "node-1.kube-proxy"}
    assert "--system-reserved=cpu=1750m" in spawned["node-1.kubelet"]


def test_up_summary_lists_each_nodes_limit(fake_host: CpuHierarchy, tmp_path: Path) -> None:
    lines = realcli._cpu_lines(RealCluster(tmp_path, nodes=3, node_cpus=[0.8, 0.8, 0.27]))
    assert [line.split(" limited to ")[0] for line in lines] == ["node-0", "node-1", "node-2"]
    assert "0.27 CPU" in lines[2] and "allocatable cpu 270m" in lines[2]
    assert realcli._cpu_lines(RealCluster(tmp_path, nodes=3)) == []


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--real-nodes", "2", "--node-cpus", "0.5"], "--node-cpus: 1 values for 2 nodes"),
        (["--node-cpus", "0.8,x,1"], "--node-cpus: 'x' is not a number of CPUs"),
        (["--node-cpus", "0.8,0.001,1"], "--node-cpus: 0.001 CPUs for node-1"),
    ],
)
def test_the_command_refuses_bad_node_cpus_naming_the_option(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--state", str(tmp_path / "state.json"), *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err
