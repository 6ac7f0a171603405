"""A local Kubernetes cluster: the real control plane plus real kubelet nodes (or, as a test double,
our process node agent).

    python -m devcluster up      # root: 3 real kubelet nodes with containerd (devcluster/realcli.py)
    python -m devcluster status  # is it up, where are its files
    python -m devcluster down    # stops everything it started; nothing is left running
    python -m devcluster up --process-nodes  # the test double: pods as local processes, no root

Real nodes are what a user meets. The process node agent (node_agent.py, pod_runner.py, podspec.py)
stays as a named test double for the tiers whose hundreds of short-lived pods would each pay a
container's set-up on two cores (the operator and packaging tiers, the 100-job scale benchmark); see
devcluster/README.md. With it, `up` starts a daemon (`serve`) in its own session that owns the
cluster and writes a state file (pids, kubeconfig, workdir, the agent's process tag). `down` asks it
to stop (SIGTERM), then kills whatever survived by pid and by tag and removes the files, so even a
SIGKILLed daemon leaves nothing. Tests use LocalCluster directly (the `cluster` fixture in
devcluster/pytest_plugin.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devcluster import realcli, realcpus
from devcluster.controlplane import ControlPlane
from devcluster.kube import KubeApi
from devcluster.node_agent import NodeAgent, NodeSpec
from devcluster.proctree import alive, kill_tagged, reap_orphans

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STATE = Path(tempfile.gettempdir()) / "sgdjob-devcluster" / "state.json"
GPU_LABEL = "nvidia.com/gpu.present"


def default_nodes(gpu_nodes: int = 4, cpu_nodes: int = 1) -> list[NodeSpec]:
    """node-0.. with one `nvidia.com/gpu` each (labelled nvidia.com/gpu.present=true), then CPU-only nodes."""
    gpu = [NodeSpec(f"node-{i}", gpus=1, labels={GPU_LABEL: "true"}) for i in range(gpu_nodes)]
    return gpu + [NodeSpec(f"node-{gpu_nodes + i}") for i in range(cpu_nodes)]


class LocalCluster:
    """ControlPlane(with_controllers=True) + NodeAgent; agent options pass through. `plane_tag`: the
    control plane's owner tag (ControlPlane.owner_tag), for a test harness."""

    def __init__(
        self, nodes: Sequence[NodeSpec] | None = None, plane_tag: str | None = None, **agent_options: Any
    ) -> None:
        self.node_specs = list(nodes if nodes is not None else default_nodes())
        self.agent_options = agent_options
        self.plane = ControlPlane(with_controllers=True, owner_tag=plane_tag)
        self._agent: NodeAgent | None = None

    @property
    def agent(self) -> NodeAgent:
        if self._agent is None:
            raise RuntimeError("cluster not started")
        return self._agent

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    @property
    def ca_file(self) -> Path:
        return self.plane.workdir / "certs" / "apiserver.crt"  # kube-apiserver's self-signed bundle

    def kube(self) -> KubeApi:
        return KubeApi(self.kubeconfig, ca_file=self.ca_file)

    def start(self, timeout: float = 60.0) -> LocalCluster:
        self.plane.start()
        try:
            options = {"ca_file": self.ca_file, **self.agent_options}
            self._agent = NodeAgent(self.kubeconfig, self.node_specs, self.plane.workdir / "agent", **options).start()
            self._wait_schedulable(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_schedulable(self, timeout: float) -> None:
        """Until every node is Ready without a not-ready taint, so the first pods schedule at once."""
        kube, deadline, names = self.kube(), time.monotonic() + timeout, {n.name for n in self.node_specs}
        while time.monotonic() < deadline:
            ok = set()
            for node in kube.get("/api/v1/nodes")["items"]:
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", [])
                )
                tainted = any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints") or [])
                if ready and not tainted:
                    ok.add(node["metadata"]["name"])
            if names <= ok:
                return
            time.sleep(0.3)
        raise TimeoutError(f"nodes not schedulable after {timeout}s: {sorted(names - ok)}")

    def stop(self) -> None:
        """Agent first (its processes), then the control plane (its processes and files)."""
        if self._agent is not None:
            self._agent.stop()
        self.plane.stop()


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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state = Path(args.state)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(default_nodes(args.gpu_nodes, args.cpu_nodes))
    try:
        cluster.start()
        info = {
            "pid": os.getpid(),
            "kubeconfig": str(cluster.kubeconfig),
            "workdir": str(cluster.plane.workdir),
            "pids": {name: proc.pid for name, proc in cluster.plane.procs.items()},
            "tag": cluster.agent.tag,
            "api_port": cluster.plane.api_port,
            "nodes": [n.name for n in cluster.node_specs],
        }
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(state)  # atomic: `up` never reads half a file
        print(f"cluster up: {json.dumps(info)}", flush=True)
        stop.wait()
    finally:
        cluster.stop()
        state.unlink(missing_ok=True)
    return 0


def _up(args: argparse.Namespace) -> int:
    reap_orphans()  # pods left by an earlier agent that was SIGKILLed
    state = Path(args.state)
    info = _read_state(state)
    if not args.process_nodes:
        if info and info.get("kind") != "real" and alive(int(info["pid"])):
            return _refuse_mixed("a process-node cluster")
        ensure_assets()
        return realcli.up(args, info)
    if info and info.get("kind") == "real":
        return _refuse_mixed("a real-node cluster")
    if info and alive(int(info["pid"])):
        print(f"already up (pid {info['pid']}); take it down with: python -m devcluster down", file=sys.stderr)
        print(f"export KUBECONFIG={info['kubeconfig']}")
        return 0
    state.parent.mkdir(parents=True, exist_ok=True)
    state.unlink(missing_ok=True)
    ensure_assets()
    logfile = state.with_suffix(".log")
    argv = [sys.executable, "-m", "devcluster", "serve", "--state", str(state)]
    argv += ["--gpu-nodes", str(args.gpu_nodes), "--cpu-nodes", str(args.cpu_nodes)]
    with open(logfile, "wb") as out:
        daemon = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        info = _read_state(state)
        if info:
            print(
                f"# local cluster up: nodes {', '.join(info['nodes'])}; logs and pod folders under {info['workdir']}",
                file=sys.stderr,
            )
            print(f"export KUBECONFIG={info['kubeconfig']}")
            return 0
        if daemon.poll() is not None:
            print(
                f"cluster failed to start (exit {daemon.returncode}); log {logfile}:\n{logfile.read_text()[-3000:]}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.3)
    daemon.terminate()
    print(f"cluster not up after {args.timeout}s; log {logfile}", file=sys.stderr)
    return 1


def _refuse_mixed(what: str) -> int:
    print(f"{what} is up with this state file: python -m devcluster down first", file=sys.stderr)
    return 1


def _down(args: argparse.Namespace) -> int:
    state = Path(args.state)
    info = _read_state(state)
    if not info:
        print("no cluster state: nothing to take down", file=sys.stderr)
        return 0
    if info.get("kind") == "real":
        return realcli.down(args, info)
    pid = int(info["pid"])
    if alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    # Whatever survived a crashed or stuck daemon: its own process, the plane's sessions, the pods.
    expected = {pid: "devcluster", **{int(p): name for name, p in info["pids"].items()}}
    for leftover, name in expected.items():
        if alive(leftover) and name in _cmdline(leftover):  # the pid is still ours, not reused
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(leftover, signal.SIGKILL)
    killed = kill_tagged(str(info["tag"]))
    shutil.rmtree(info["workdir"], ignore_errors=True)
    state.unlink(missing_ok=True)
    print(f"cluster down{f' (killed {len(killed)} leftover pod processes)' if killed else ''}", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    info = _read_state(Path(args.state))
    if info and info.get("kind") == "real":
        return realcli.status(info)
    if not info or not alive(int(info["pid"])):
        print("down")
        return 1
    print(f"up (pid {info['pid']}): export KUBECONFIG={info['kubeconfig']}  # files under {info['workdir']}")
    return 0


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
    parser.add_argument("command", choices=["up", "down", "status", "serve", "images"])
    parser.add_argument("--state", default=str(DEFAULT_STATE), help=f"state file (default {DEFAULT_STATE})")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds `up` waits (default 300, 120 with process nodes)"
    )
    real = parser.add_argument_group(
        "real nodes (the default; root; kubelet + containerd per node, devcluster/realnodes.py)"
    )
    real.add_argument("--real-nodes", type=int, default=3, help="up: this many real kubelet nodes (default 3)")
    real.add_argument("--workdir", default=str(realcli.DEFAULT_WORKDIR), help="up: the real cluster's folder")
    real.add_argument("--images", default="", help="up: also import these images, e.g. operator,trainer")
    real.add_argument(
        "--node-cpus",
        type=_node_cpus,
        default=None,
        help="up: CPUs per real node, node-0 first, e.g. 0.8,0.8,0.27: a cgroup CPU quota on each node's pods, "
        "advertised as its allocatable CPU (devcluster/realcpus.py)",
    )
    real.add_argument(
        "--only", default="operator,trainer", help="images: which (pause,python,torch,operator,trainer,charlm)"
    )
    real.add_argument("--rebuild", action="store_true", help="images: build even when the cache is current")
    double = parser.add_argument_group("process nodes (a test double: pods as local processes, no root)")
    double.add_argument("--process-nodes", action="store_true", help="up: the process node agent instead of kubelets")
    double.add_argument(
        "--gpu-nodes", type=int, default=4, help="process nodes with one nvidia.com/gpu each (default 4)"
    )
    double.add_argument("--cpu-nodes", type=int, default=1, help="process nodes without GPUs (default 1)")
    args = parser.parse_args(argv)
    if args.node_cpus is not None:
        if args.process_nodes:
            parser.error(
                "--node-cpus limits real nodes' cgroups; process nodes have none: drop --node-cpus or --process-nodes"
            )
        try:
            realcpus.validate(args.node_cpus, args.real_nodes)
        except ValueError as err:
            parser.error(str(err))
    if args.timeout is None:
        args.timeout = 120.0 if args.process_nodes else 300.0  # image imports and three kubelets on two cores
    if args.command == "images":
        ensure_assets()
        return realcli.images(args, _read_state(Path(args.state)))
    return {"up": _up, "down": _down, "status": _status, "serve": _serve}[args.command](args)
