"""The real-node side of `python -m devcluster` (devcluster/cluster.py parses the arguments):

    eval "$(python -m devcluster up [--real-nodes 3] [--images operator,trainer])"   # root; sets KUBECONFIG, PATH
    python -m devcluster up --real-nodes 3 --node-cpus 0.8,0.8,0.27      # slow nodes: a CPU quota each
    python -m devcluster images [--only operator] [--rebuild]            # build (cached) + import into the nodes
    python -m devcluster status
    python -m devcluster down                                            # stops everything it started

There is no daemon: the cluster's processes run on their own, and the state file points at the
cluster's folder, whose state.json lists them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from devcluster import realcpus, realnet
from devcluster.controlplane import assets_dir
from devcluster.images import ImageBuilder, default_cache
from devcluster.realconf import Layout
from devcluster.realnodes import RealCluster

DEFAULT_WORKDIR = default_cache().parent / "realnodes"
BASE_IMAGES = ("pause", "python")  # every node: the pod sandbox, and a small image for tests and people
OLD_STATE = "stop its daemon (the pid in the file) and remove the file"


def _names(csv: str) -> list[str]:
    return [n for n in (s.strip() for s in csv.split(",")) if n]


def _is_up(info: dict[str, Any]) -> bool:
    return realnet.exists(Layout(Path(info["workdir"]), int(info["nodes"]), str(info["prefix"])).fabric_ns)


def up(args: argparse.Namespace, info: dict[str, Any] | None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    state = Path(args.state)
    if info and info.get("kind") == "real":
        if _is_up(info):
            print("already up; take it down with: python -m devcluster down", file=sys.stderr)
            if args.node_cpus and args.node_cpus != info.get("node_cpus"):
                print(
                    f"--node-cpus {','.join(f'{c:g}' for c in args.node_cpus)} not applied: the cluster runs with "
                    f"{info.get('node_cpus') or 'no CPU limits'}; limits are set at up (down first)",
                    file=sys.stderr,
                )
            _print_env(Path(info["kubeconfig"]))
            return 0
        print("cleaning up a real cluster that is no longer complete", file=sys.stderr)
        RealCluster.load(Path(info["workdir"])).stop()
    elif info:
        print(f"{args.state} records a process-node cluster of an older devcluster: {OLD_STATE}", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    builder = ImageBuilder()
    images = [builder.get(n) for n in [*BASE_IMAGES, *_names(args.images)]]
    built = time.monotonic() - t0
    cluster = RealCluster(Path(args.workdir), args.real_nodes, node_cpus=args.node_cpus)
    cluster.start(images, timeout=args.timeout)
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(cluster.state(), indent=1))
    print(
        f"# real cluster up: nodes {', '.join(cluster.node_names())}; images {built:.1f} s, cluster "
        f"{cluster.timings.get('ready', 0):.1f} s ({cluster.timings}); files under {cluster.layout.workdir}",
        file=sys.stderr,
    )
    for line in _cpu_lines(cluster):
        print(f"# {line}", file=sys.stderr)
    _print_env(cluster.kubeconfig)
    return 0


def _cpu_lines(cluster: RealCluster) -> list[str]:
    """`up`'s summary of the nodes' CPU limits (none: every node has the whole machine)."""
    if not cluster.node_cpus:
        return []
    by_node = dict(zip(cluster.node_names(), cluster.node_cpus, strict=True))
    return realcpus.describe(by_node, realcpus.hierarchy().version, realcpus.machine_cpus())


def _print_env(kubeconfig: Path) -> None:
    """For `eval`: the cluster's kubeconfig, and the kubectl and helm that come with the control plane."""
    print(f"export KUBECONFIG={kubeconfig}")
    print(f'export PATH="{assets_dir()}:$PATH"')


def down(args: argparse.Namespace, info: dict[str, Any]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    workdir = Path(info["workdir"])
    if not (workdir / "state.json").is_file():
        print(f"no {workdir / 'state.json'}: nothing to take down", file=sys.stderr)
        Path(args.state).unlink(missing_ok=True)
        return 0
    t0 = time.monotonic()
    problems = RealCluster.load(workdir).stop()
    Path(args.state).unlink(missing_ok=True)
    for p in problems:
        print(f"left behind: {p}", file=sys.stderr)
    print(f"real cluster down in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 1 if problems else 0


def status(info: dict[str, Any]) -> int:
    if not _is_up(info):
        print("down (a stale real-cluster state file: python -m devcluster down cleans up)")
        return 1
    print(f"up, real nodes {', '.join(info['node_names'])}: export KUBECONFIG={info['kubeconfig']}")
    if info.get("node_cpus"):
        print(f"node CPUs (cgroup quota): {dict(zip(info['node_names'], info['node_cpus'], strict=True))}")
    return 0


def images(args: argparse.Namespace, info: dict[str, Any] | None) -> int:
    """Build (or take from the cache) the named images; import them into the real cluster when it is up."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    builder = ImageBuilder(rebuild=args.rebuild)
    built = [builder.get(n) for n in _names(args.only)]
    print(f"# builds (s): {builder.timings}", file=sys.stderr)
    if info and info.get("kind") == "real" and _is_up(info):
        cluster = RealCluster.load(Path(info["workdir"]))
        print(f"# imported (s): {cluster.import_images(built)}", file=sys.stderr)
    for img in built:
        print(f"{img.ref} {img.archive}")
    return 0
