"""A local Kubernetes cluster: the real control plane plus real kubelet nodes with containerd.

    python -m devcluster up      # root: 3 real kubelet nodes with containerd (devcluster/realcli.py)
    python -m devcluster status  # is it up, where are its files
    python -m devcluster images  # build (cached) and import the project's images into the nodes
    python -m devcluster down    # stops everything it started; nothing is left running

Tests use RealCluster directly (the `real_cluster` fixture in devcluster/pytest_plugin.py), or a bare
control plane (`k8s`) where no pod needs to run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devcluster import realcli, realcpus

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STATE = Path(tempfile.gettempdir()) / "sgdjob-devcluster" / "state.json"


def ensure_assets() -> None:
    """For people: find the binaries via ../shared/k8s/install.sh when KUBEBUILDER_ASSETS is unset."""
    installer = ROOT.parent / "shared" / "k8s" / "install.sh"
    if not os.environ.get("KUBEBUILDER_ASSETS") and installer.is_file():
        os.environ["KUBEBUILDER_ASSETS"] = subprocess.run(
            [str(installer)], capture_output=True, text=True, check=True
        ).stdout.strip()


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _up(args: argparse.Namespace) -> int:
    ensure_assets()
    return realcli.up(args, _read_state(Path(args.state)))


def _down(args: argparse.Namespace) -> int:
    info = _read_state(Path(args.state))
    if not info:
        print("no cluster state: nothing to take down", file=sys.stderr)
        return 0
    if info.get("kind") != "real":
        print(
            f"{args.state} records a process-node cluster of an older devcluster: {realcli.OLD_STATE}", file=sys.stderr
        )
        return 1
    return realcli.down(args, info)


def _status(args: argparse.Namespace) -> int:
    info = _read_state(Path(args.state))
    if not info or info.get("kind") != "real":
        print("down")
        return 1
    return realcli.status(info)


def _node_cpus(text: str) -> list[float]:
    try:
        return realcpus.parse(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down", "status", "images"])
    parser.add_argument("--state", default=str(DEFAULT_STATE), help=f"state file (default {DEFAULT_STATE})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds `up` waits (default 300)")
    parser.add_argument("--real-nodes", type=int, default=3, help="up: this many kubelet nodes (default 3)")
    parser.add_argument("--workdir", default=str(realcli.DEFAULT_WORKDIR), help="up: the cluster's folder")
    parser.add_argument("--images", default="", help="up: also import these images, e.g. operator,trainer")
    parser.add_argument(
        "--node-cpus",
        type=_node_cpus,
        default=None,
        help="up: CPUs per node, node-0 first, e.g. 0.8,0.8,0.27: a cgroup CPU quota on each node's pods, "
        "advertised as its allocatable CPU (devcluster/realcpus.py)",
    )
    parser.add_argument(
        "--only", default="operator,trainer", help="images: which (pause,python,torch,operator,trainer,charlm)"
    )
    parser.add_argument("--rebuild", action="store_true", help="images: build even when the cache is current")
    args = parser.parse_args(argv)
    if args.node_cpus is not None:
        try:
            realcpus.validate(args.node_cpus, args.real_nodes)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "images":
        ensure_assets()
        return realcli.images(args, _read_state(Path(args.state)))
    return {"up": _up, "down": _down, "status": _status}[args.command](args)
