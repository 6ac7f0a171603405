"""Goodput on real slow nodes (issue #37 point 1): every system trains the benchmark's task with REAL
compute only (no `training.emulation`) as SGDJobs on a local real-node cluster whose nodes are made
unequal by their cgroup CPU quota, through the operator `helm install`ed from charts/sgdjob-operator.

    python -m bench.goodput_nodes --out DIR [--fleet 0.8,0.8,0.27] [--fleet 0.6,0.6,0.6] [--seeds 3]

Root only (the cluster's kubelets, containerd and network namespaces: devcluster/realnodes.py). Per
fleet (one `--fleet` each: the CPUs of each node, one worker per node) it starts the cluster with those
quotas, builds and imports the project's images, installs the chart (two operator replicas, as the
chaos suite does), runs every system x seed one job at a time, and takes the cluster down. Systems:
- `ddp`: the plain DDP script (bench.ddp_baseline: torch DistributedDataParallel, one batch size) run
  unmodified by an SGDJob in command mode (`training.command`), one pod per node: what a user of
  Kubeflow's PyTorchJob runs, under the same torchrun agent and on the same pods as ours;
- `ddp-drop`: the same on every node but the slowest (a node affinity keeps it off);
- `lb-bsp`: SGDJob mode sync with `training.rankBatchSizes` from step 0, proportional to the nodes'
  CPUs (what a user who knows the fleet writes); torchrun orders ranks by pod IP, which follows the
  node's index here, and the run is marked failed if the small batch did not land on the slow node;
- `auto` at the benchmark's short policy interval, `auto-default` at the shipping default one; both
  elastic (minReplicas one below replicas, `rescale` allowed besides switchMode and rebalance), as the
  user of an elastic job sets it, so the policy may drop the slow node as ddp-drop does by hand, with
  a checkpoint every CHECKPOINT_STEPS steps in the run folder to restart from.
A fleet of equal nodes runs ddp, auto and auto-default only (no node to drop, lb-bsp's split is DDP's).

Each worker writes its rank file into a host folder mounted into every pod (hostPath: the nodes share
the host's filesystem); the figures are the local benchmark's (bench.goodput_scoring): time to the
target validation accuracy and accuracy at the budget, seconds since training start (pod start-up and
rendezvous excluded for every system alike), and the issue's targets on the medians. Writes
DIR/goodput-nodes.json and DIR/goodput-nodes.md (also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.goodput import DEFAULT_TASK, TASKS, at_shipping_interval, run_order, scored
from bench.goodput_scoring import aggregate, markdown_table
from bench.goodput_targets import Check, accuracy_kept, as_json, time_ratio
from bench.goodput_targets import markdown as targets_markdown
from bench.scenarios import BenchConfig, Scenario, ddp_run_config, training
from bench.systems import REPO_ROOT, RunRecord, code_paths

STRAGGLER_FLEET = (0.8, 0.8, 0.27)  # one node at a third of the others' CPU
EQUAL_FLEET = (0.6, 0.6, 0.6)
SYSTEMS = ("ddp", "ddp-drop", "lb-bsp", "auto", "auto-default")
EQUAL_SYSTEMS = ("ddp", "auto", "auto-default")
NAMESPACE = "goodput"
CHECKPOINT_STEPS = 50  # the autos' checkpoints (async writes; a few ms a step of the digits models)
JOB_TIMEOUT_S = 600.0
LABEL_JOB, LABEL_ROLE = "sgdjob.dev/job-name", "sgdjob.dev/role"
# What bench.scenarios' builders take for a scenario: here the nodes' quotas make the ranks unequal.
REAL_NODES = Scenario("real-nodes", "real CPU quotas per node, no emulation", (), ())


@dataclass(frozen=True, slots=True)
class Fleet:
    """Nodes with their CPU quotas, in node order (one worker per node)."""

    cpus: tuple[float, ...]
    nodes: tuple[str, ...]

    @property
    def name(self) -> str:
        return "cpus-" + "-".join(f"{c:g}" for c in self.cpus)

    @property
    def equal(self) -> bool:
        return len(set(self.cpus)) == 1

    @property
    def slowest(self) -> int:
        """Index of the slowest node (the last of equals)."""
        return max(range(len(self.cpus)), key=lambda i: (-self.cpus[i], i))

    def systems(self, asked: Sequence[str]) -> list[str]:
        return [s for s in asked if not self.equal or s in EQUAL_SYSTEMS]


def lb_split(cfg: BenchConfig, fleet: Fleet) -> list[int]:
    """lb-bsp's per-rank batches: proportional to each node's CPUs, summing to the global batch
    (rank r on node r: torchrun orders ranks by pod IP, 10.244.<node index>.x here)."""
    from sgdjob_operator.policy.plans import rebalanced_batches

    total = len(fleet.cpus) * cfg.batch_size
    speeds = dict(enumerate(fleet.cpus))
    split = rebalanced_batches(speeds, total, {r: total for r in speeds})
    return [split[r] for r in range(len(fleet.cpus))]


def _template(name: str, run_dir: Path, avoid: str | None, paths: Sequence[str]) -> dict[str, Any]:
    """One worker per node (required pod anti-affinity among the job's workers), `avoid` kept off by
    node affinity, the run folder mounted at its host path (rank files), the repository too when
    `paths` (the PYTHONPATH of code that is not in the trainer image: the DDP script, a task's own
    folder such as charlm's) name any."""
    mounts: list[dict[str, Any]] = [{"name": "run", "mountPath": str(run_dir)}]
    volumes: list[dict[str, Any]] = [{"name": "run", "hostPath": {"path": str(run_dir), "type": "Directory"}}]
    env = [{"name": "SGDJOB_REPORT_DIR", "value": str(run_dir / "report")}]
    if paths:
        mounts.append({"name": "code", "mountPath": str(REPO_ROOT), "readOnly": True})
        volumes.append({"name": "code", "hostPath": {"path": str(REPO_ROOT), "type": "Directory"}})
        env.append({"name": "PYTHONPATH", "value": ":".join(paths)})
    workers = {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: "worker"}}
    affinity: dict[str, Any] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": workers, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }
    if avoid is not None:
        term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [avoid]}]}
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    container = {"name": "trainer", "env": env, "volumeMounts": mounts}
    return {"spec": {"containers": [container], "volumes": volumes, "affinity": affinity}}


def pythonpath(cfg: BenchConfig, system: str) -> tuple[str, ...]:
    """The workers' PYTHONPATH beyond the trainer image: the task's own folders (as every system of the
    local benchmark has them), and the repository for the DDP script (`bench.ddp_baseline`)."""
    return (*code_paths(cfg), *([str(REPO_ROOT)] if system.startswith("ddp") else []))


def job_manifest(cfg: BenchConfig, fleet: Fleet, system: str, name: str, run_dir: Path) -> dict[str, Any]:
    """The SGDJob of one run (pure). `run_dir` holds the DDP script's run-config (ddp systems) and gets
    the rank files under report/."""
    drop = system == "ddp-drop"
    workers = len(fleet.cpus) - (1 if drop else 0)
    spec: dict[str, Any] = {
        "replicas": workers,
        "minReplicas": workers,
        "maxReplicas": workers,
        "nprocPerNode": 1,
        "template": _template(name, run_dir, fleet.nodes[fleet.slowest] if drop else None, pythonpath(cfg, system)),
    }
    if system in ("ddp", "ddp-drop"):
        spec |= {
            "mode": "sync",
            "training": {
                "command": ["python", "-m", "bench.ddp_baseline", "--config", str(run_dir / "run-config.json")],
            },
        }
    else:
        train = training(cfg, REAL_NODES, hierarchical_groups=False)
        train.pop("emulation")  # real compute only
        mode, policy = "auto" if system.startswith("auto") else "sync", cfg.policy
        if system == "auto-default":
            policy = at_shipping_interval(cfg).policy
        if mode == "auto":
            # An elastic job, as a user of one sets it: one worker may go, and the policy may take it.
            spec["minReplicas"] = workers - 1
            policy = {**policy, "allowedActions": [*policy.get("allowedActions", []), "rescale"]}
            # A rescale restarts the world from the last checkpoint (shared: the run folder is a hostPath).
            train["checkpoint"] = {"dir": str(run_dir / "checkpoints"), "intervalSteps": CHECKPOINT_STEPS}
        if system == "lb-bsp":
            train["rankBatchSizes"] = lb_split(cfg, fleet)
            # Static: on Kubernetes the policy also rebalances a job of mode sync unless told not to.
            policy = {**policy, "allowedActions": []}
        spec |= {"mode": mode, "training": train, "policy": dict(policy)}
    return {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": name}, "spec": spec}


def ddp_config(cfg: BenchConfig, fleet: Fleet, system: str) -> dict[str, Any]:
    """The DDP script's run-config: no emulation; ddp-drop on one worker fewer, its learning rate
    scaled by the job's lrScaling rule as SGDJob would (reference world size: the full fleet)."""
    n = len(fleet.cpus)
    run_cfg = replace(cfg, workers=n - 1, reference_workers=n) if system == "ddp-drop" else replace(cfg, workers=n)
    doc = ddp_run_config(run_cfg, REAL_NODES)
    doc["training"].pop("emulation")
    return doc


def lb_landed(split: Sequence[int], rank_docs: Sequence[Mapping[str, Any]], slow_node: str) -> str | None:
    """Why lb-bsp's split missed the slow node (None when the smallest batch ran there)."""
    small = min(range(len(split)), key=lambda r: split[r])
    node = next((d.get("node") for d in rank_docs if d.get("rank") == small), None)
    return None if node == slow_node else f"lb-bsp's smallest batch (rank {small}) ran on {node}, not {slow_node}"


def node_checks(results: Sequence[Mapping[str, Any]]) -> list[Check]:
    """Issue #37's targets for real slow nodes, on the medians: with one slow node auto's time to target
    <= 0.6x DDP's and <= 1.0x the best other system's, its accuracy at the budget >= DDP's; on an equal
    fleet <= 1.02x DDP's. Both autos scored (auto-default reported, not binding)."""
    checks: list[Check] = []
    for r in results:
        fleet, systems = str(r["scenario"]), r["systems"]
        autos = [a for a in ("auto", "auto-default") if a in systems]
        for auto in autos:
            binding = auto == "auto"
            if r.get("equal"):
                checks.append(time_ratio(results, fleet, 1.02, "ddp", "equal fleet: <= 1.02x DDP", auto, binding))
            else:
                checks.append(time_ratio(results, fleet, 0.6, "ddp", "slow node: <= 0.6x DDP", auto, binding))
                checks.append(time_ratio(results, fleet, 1.0, None, "slow node: <= 1.0x best other", auto, binding))
            checks.append(accuracy_kept(results, fleet, auto, binding))
    return checks


# --- the imperative shell: a cluster per fleet, one job at a time ---


PodLogs = Callable[[str, str], dict[str, str]]  # (namespace, pod name prefix) -> {kubelet log path: text}


def keep_logs(logs: Mapping[str, str], folder: Path) -> None:
    """The kubelet's container logs (`.../<ns>_<pod>_<uid>/<container>/<n>.log`, every line timestamped)
    as `<pod>.<container>.<n>.log` in `folder`: what each life of each pod did, and when, after the run."""
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in logs.items():
        parts = Path(path).parts
        pod = parts[-3].split("_")[1] if parts[-3].count("_") >= 2 else parts[-3]
        (folder / f"{pod}.{parts[-2]}.{Path(parts[-1]).stem}.log").write_text(text)


def keep_run_logs(logs: PodLogs, name: str, folder: Path) -> None:
    """The job's pod logs (`keep_logs`), and the operator's lines about the job as `operator.log` (with
    --operator-verbose every policy pass's reason, a kept configuration's too)."""
    from e2e.real import OPERATOR_NS, RELEASE

    keep_logs(logs(NAMESPACE, f"{name}-"), folder)
    mine = f"{NAMESPACE}/{name}"
    lines = [
        line
        for text in logs(OPERATOR_NS, f"{RELEASE}-").values()
        for line in text.splitlines()
        if any(mine + end in line for end in (":", " ", "]"))  # kopf's prefix is [namespace/name]
    ]
    (folder / "operator.log").write_text("".join(f"{line}\n" for line in sorted(lines)))


def run_job(
    kube: Any, manifest: Mapping[str, Any], timeout_s: float, before_delete: Callable[[], None] | None = None
) -> tuple[float, dict[str, Any]]:
    """Create the job, wait until it ends (or `timeout_s`), run `before_delete`, delete it and wait its
    pods out. Returns the seconds from create to its end and its last status."""
    name = manifest["metadata"]["name"]
    path = f"/apis/sgdjob.dev/v1alpha1/namespaces/{NAMESPACE}/sgdjobs"
    start = time.monotonic()
    kube.create(path, dict(manifest))
    status: dict[str, Any] = {}
    while time.monotonic() - start < timeout_s:
        status = dict((kube.get_or_none(f"{path}/{name}") or {}).get("status") or {})
        if status.get("phase") in ("Succeeded", "Failed"):
            break
        time.sleep(1.0)
    harness = time.monotonic() - start
    if before_delete is not None:
        before_delete()
    kube.delete(f"{path}/{name}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pods = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector=f"{LABEL_JOB}={name}")["items"]
        if not pods:
            break
        time.sleep(1.0)
    return harness, status


def run_one(
    kube: Any, cfg: BenchConfig, fleet: Fleet, system: str, seed: int, run_dir: Path, logs: PodLogs | None = None
) -> RunRecord:
    from sgdjob_operator.local.report import build_report, final_world, load_rank_docs

    seeded = replace(cfg, seed=seed)
    (run_dir / "report").mkdir(parents=True, exist_ok=True)
    for folder in (run_dir, run_dir / "report"):
        folder.chmod(0o777)  # the trainer runs as uid 10001
    if system.startswith("ddp"):
        (run_dir / "run-config.json").write_text(json.dumps(ddp_config(seeded, fleet, system), indent=2) + "\n")
    manifest = job_manifest(seeded, fleet, system, f"{system}-s{seed}", run_dir)
    (run_dir / "job.json").write_text(json.dumps(manifest, indent=1) + "\n")
    name = manifest["metadata"]["name"]
    save = None if logs is None else (lambda: keep_run_logs(logs, name, run_dir / "logs"))
    harness, status = run_job(kube, manifest, JOB_TIMEOUT_S, before_delete=save)
    every, _ = load_rank_docs(run_dir / "report")
    # After a shrink the removed rank's file of the world before is still there.
    docs, world = final_world(every)
    error = None if status.get("phase") == "Succeeded" else f"job {status.get('phase')}: {status.get('message')}"
    if system.startswith("ddp"):
        return RunRecord(system, run_dir, harness, rank_docs=docs, error=error)
    if system == "lb-bsp" and error is None:
        error = lb_landed(manifest["spec"]["training"]["rankBatchSizes"], docs, fleet.nodes[fleet.slowest])
    report = build_report(
        docs,
        job=manifest["metadata"]["name"],
        mode=manifest["spec"]["mode"],
        expected_workers=world or len(fleet.cpus),
        emulation=None,
        extra={"decisions": list(status.get("decisions") or [])},
    )
    (run_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return RunRecord(system, run_dir, harness, report=report, error=error)


def run_systems(
    kube: Any, fleet: Fleet, cfg: BenchConfig, systems: Sequence[str], seeds: Sequence[int], out: Path, *,
    target: float, budget_s: float, log: Any = sys.stderr, logs: PodLogs | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every system x seed of `fleet`, one job at a time, on a cluster whose operator is installed and
    whose namespace NAMESPACE exists; the fleet's result (bench.goodput's shape, the fleet as scenario).
    With `logs`, each run's pod logs are kept in its folder (`logs/`)."""
    t0 = time.monotonic()
    chosen = fleet.systems(systems)
    per_system: dict[str, list[dict[str, Any]]] = {s: [] for s in chosen}
    for i, seed in enumerate(seeds):
        for system in run_order(chosen, i):
            print(f"[{time.monotonic() - t0:6.0f}s] {fleet.name}: {system} seed {seed} ...", file=log, flush=True)
            run_dir = out / "runs" / fleet.name / system / f"seed-{seed}"
            record = run_one(kube, cfg, fleet, system, seed, run_dir, logs)
            workers = len(fleet.cpus) - (1 if system == "ddp-drop" else 0)
            per_system[system].append(scored(record, workers, target, budget_s, log))
    return {
        "scenario": fleet.name,
        "description": f"{len(fleet.cpus)} real nodes, CPU quotas {list(fleet.cpus)}, one worker each, no emulation",
        "equal": fleet.equal,
        "nodes": list(fleet.nodes),
        "cpus": list(fleet.cpus),
        "workers": len(fleet.cpus),
        "steps": cfg.steps,
        "lb_bsp_batches": None if fleet.equal else lb_split(cfg, fleet),
        "ddp_drop_node": None if fleet.equal else fleet.nodes[fleet.slowest],
        "systems": {s: aggregate(runs) for s, runs in per_system.items()},
    }


def make_namespace(kube: Any) -> None:
    from devcluster.testing import wait_ready_namespace

    if kube.get_or_none(f"/api/v1/namespaces/{NAMESPACE}") is None:
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    wait_ready_namespace(kube, NAMESPACE)


def run_fleet(
    cpus: Sequence[float], cfg: BenchConfig, systems: Sequence[str], seeds: Sequence[int], out: Path, *,
    target: float, budget_s: float, log: Any = sys.stderr, operator_args: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """Start a real-node cluster with `cpus`, install the operator (Helm, with `operator_args`), run every
    system x seed, stop it."""
    from devcluster.images import ImageBuilder
    from devcluster.realnodes import RealCluster
    from e2e.real import OPERATOR_IMAGES, install_operator

    workdir = Path(tempfile.mkdtemp(prefix="sgdjob-goodput-"))
    builder = ImageBuilder()
    images = [builder.get(name) for name in ("pause", "python", *OPERATOR_IMAGES)]
    cluster = RealCluster(workdir / "cluster", nodes=len(cpus), prefix="sgdgp", node_cpus=list(cpus))
    t0 = time.monotonic()
    cluster.start(images)
    try:
        install_operator(cluster, workdir, extra_args=operator_args)
        kube = cluster.kube()
        make_namespace(kube)
        fleet = Fleet(tuple(cpus), tuple(cluster.node_names()))
        print(f"[{time.monotonic() - t0:6.0f}s] fleet {fleet.name} up: nodes {fleet.nodes}", file=log, flush=True)
        return run_systems(
            kube, fleet, cfg, systems, seeds, out, target=target, budget_s=budget_s, log=log, logs=cluster.pod_logs
        )
    finally:
        cluster.stop()


def _cpus(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--fleet wants CPUs per node, e.g. 0.8,0.8,0.27: {err}") from err
    if len(values) < 2 or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"--fleet wants at least 2 positive CPU figures, got {text!r}")
    return values


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM, and SIGINT where a background shell set it to be ignored, end the run through its
    # clean-up: each fleet's cluster is stopped (killed outright, the cluster's daemons ran on).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    parser = argparse.ArgumentParser(prog="python -m bench.goodput_nodes", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--fleet", type=_cpus, action="append",
        help=f"CPUs of each node, comma-separated; repeat for more fleets (default {STRAGGLER_FLEET}, {EQUAL_FLEET})",
    )  # fmt: skip
    parser.add_argument("--task", choices=sorted(TASKS), default=DEFAULT_TASK)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per fleet and system")
    parser.add_argument(
        "--first-seed", type=int, default=100,
        help="the first seed (100 and up are held out from the tuning set; a seed a constant was fitted on is not)",
    )  # fmt: skip
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of systems")
    parser.add_argument("--steps", type=int, help="override the task's steps per run")
    parser.add_argument("--target", type=float, help="target validation accuracy (default: the task's)")
    parser.add_argument("--budget", type=float, help="wall-time budget, s since training start (default: the task's)")
    parser.add_argument(
        "--operator-verbose", action="store_true",
        help="run the operator with --verbose: each run's logs/operator.log then holds every policy pass's reason",
    )  # fmt: skip
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    task = TASKS[args.task]
    cfg = task.config if args.steps is None else replace(task.config, steps=args.steps)
    target = task.target_accuracy if args.target is None else args.target
    budget = task.budget_s if args.budget is None else args.budget
    seeds = [args.first_seed + k for k in range(args.seeds)]
    if os.geteuid() != 0:
        parser.error("needs root: it starts a real-node cluster (devcluster/realnodes.py)")
    assets = Path(os.environ.get("KUBEBUILDER_ASSETS", ""))
    if not (assets / "kube-apiserver").is_file() or not (assets / "helm").is_file():
        parser.error("needs the control plane and helm: export KUBEBUILDER_ASSETS=$(../shared/k8s/install.sh)")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    operator_args = ("--verbose",) if args.operator_verbose else ()
    results = [
        run_fleet(cpus, cfg, systems, seeds, args.out, target=target, budget_s=budget, operator_args=operator_args)
        for cpus in (args.fleet or [STRAGGLER_FLEET, EQUAL_FLEET])
    ]
    checks = node_checks(results)
    doc = {
        "results": results,
        "checks": as_json(checks),
        "metadata": {
            "date": started,
            "task": args.task,
            "config": asdict(cfg),
            "seeds": seeds,
            "target_accuracy": target,
            "budget_s": budget,
            "compute": "REAL compute on real kubelet nodes limited by cgroup CPU quotas; no emulation",
        },
    }
    (args.out / "goodput-nodes.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = (
        f"Goodput on real slow nodes ({args.task}, target {target:g}, budget {budget:g} s, seeds {seeds}); "
        "REAL compute, CPU quotas per node, no emulation\n\n"
        + markdown_table(results)
        + "\n"
        + targets_markdown(checks)
    )
    (args.out / "goodput-nodes.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
