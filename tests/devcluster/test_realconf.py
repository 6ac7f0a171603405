"""The pure rules of the real-node cluster: addresses, files, argv, image keys (no root, nothing started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devcluster import realconf, realhost
from devcluster.controlplane import kubeconfig_text
from devcluster.images import context_files, source_key
from devcluster.realconf import Layout

ROOT = Path(__file__).resolve().parents[2]


def test_each_node_has_its_own_addresses_cidr_and_paths(tmp_path: Path) -> None:
    lay = Layout(tmp_path, nodes=3)
    assert [lay.node_ip(i) for i in range(3)] == ["10.250.0.10", "10.250.0.11", "10.250.0.12"]
    assert [lay.pod_cidr(i) for i in range(3)] == ["10.244.0.0/24", "10.244.1.0/24", "10.244.2.0/24"]
    assert len({lay.node_ns(i) for i in range(3)} | {lay.fabric_ns}) == 4
    socks = [lay.containerd_socket(i) for i in range(3)]
    assert len(set(socks)) == 3 and all(len(f"{s}.ttrpc") < 108 for s in socks)
    kubelets = [realconf.kubelet_argv(Path("/b"), lay, i) for i in range(3)]
    for i, argv in enumerate(kubelets):
        assert f"--cgroup-root=/sgdjob-devcluster/node-{i}" in argv and f"--pod-cidr=10.244.{i}.0/24" in argv
        assert f"--root-dir={lay.node_dir(i) / 'kubelet'}" in argv
    with pytest.raises(ValueError):
        Layout(tmp_path, nodes=0)


def test_cni_and_containerd_configs_are_per_node(tmp_path: Path) -> None:
    lay = Layout(tmp_path, nodes=2)
    nets = [json.loads(realconf.cni_conflist(lay, i)) for i in range(2)]
    ranges = [n["plugins"][0]["ipam"]["ranges"][0][0] for n in nets]
    assert ranges == [
        {"subnet": "10.244.0.0/24", "gateway": "10.244.0.1"},
        {"subnet": "10.244.1.0/24", "gateway": "10.244.1.1"},
    ]
    assert all(n["plugins"][0]["ipMasq"] is False for n in nets)  # pod IPs routed as they are
    toml = realconf.containerd_toml(lay, 1)
    assert f'address = "{lay.containerd_socket(1)}"' in toml and "restrict_oom_score_adj = true" in toml
    assert str(lay.node_dir(0)) not in toml


def test_every_kubelet_is_a_node_identity(tmp_path: Path) -> None:
    lay = Layout(tmp_path, nodes=2)
    tokens = {name: f"t-{name}" for name, _, _ in lay.identities()}
    csv = realconf.tokens_csv(tokens, lay).splitlines()
    assert 't-node-1,system:node:node-1,node-1,"system:nodes"' in csv
    assert 't-admin,admin,admin,"system:masters"' in csv
    kc = json.loads(kubeconfig_text("https://10.250.0.1:6443", "system:node:node-0", "tok"))
    assert kc["users"][0]["user"]["token"] == "tok"


def test_holder_masks_the_kubelets_machine_wide_tunables(tmp_path: Path) -> None:
    realhost.prepare_node_dir(tmp_path)
    script = realhost.holder_script(tmp_path)
    for key, value in realhost.KUBELET_TUNABLES.items():
        assert f"/proc/sys/{key}" in script
        assert (tmp_path / "sysctl" / key.replace("/", ".")).read_text() == value + "\n"
    assert "/var/log" in script and script.rstrip().endswith("exec sleep infinity")
    # Each kubelet's device-plugin socket in a folder of its own node's: three sharing one race at start.
    assert f"{tmp_path / 'device-plugins'} /var/lib/kubelet/device-plugins" in script
    assert (tmp_path / "device-plugins").is_dir()


def test_image_key_covers_what_the_dockerfile_copies() -> None:
    files = {str(p.relative_to(ROOT)) for p in context_files(ROOT / "Dockerfile", ROOT)}
    assert {"pyproject.toml", "README.md", "docker/operator_requirements.py"} <= files
    assert any(f.startswith("operator/src/") for f in files) and any(f.startswith("trainer/src/") for f in files)
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def test_image_key_changes_with_the_sources_only(tmp_path: Path) -> None:
    dockerfile = "FROM x AS wheel\nCOPY pyproject.toml ./\nCOPY src/ src/\nCOPY --from=wheel /w /w\n"
    (tmp_path / "Dockerfile").write_text(dockerfile)
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("A = 1\n")
    key = source_key("trainer", "base1", tmp_path)
    (tmp_path / "src" / "__pycache__").mkdir()
    (tmp_path / "src" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    (tmp_path / "README.md").write_text("not copied\n")
    assert source_key("trainer", "base1", tmp_path) == key
    assert source_key("operator", "base1", tmp_path) != key and source_key("trainer", "base2", tmp_path) != key
    (tmp_path / "src" / "a.py").write_text("A = 2\n")
    assert source_key("trainer", "base1", tmp_path) != key
