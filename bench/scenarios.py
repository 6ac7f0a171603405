"""The heterogeneity benchmark's scenarios and the job files every system runs them from (pure).

Every scenario is EMULATED compute (the trainer's `training.emulation`: a per-rank sleep per step
standing for accelerator time, with per-rank slowdown factors); gradients are still computed and
exchanged for real over gloo. The same emulation dict goes into the DDP baseline's run-config and
into the SGDJob that `sgdjob run` starts, so every system of a scenario sees the same workers.

Bound of a scenario (the design's yardstick, one definition for every system of the scenario):
rank i's speed when never waiting is v_i = steps x batch / sum over steps of its emulated seconds
(computeSeconds x factor_i(step); the jitter averages out), computed from the emulation config,
not measured; bound = sum of v_i. Real forward/backward CPU time is not in it, so the bound is
slightly above what any system can reach (efficiencies are, if anything, understated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

SCENARIO_NAMES = ("homogeneous", "one-straggler", "bimodal", "transient")
# The goodput benchmark adds a straggler that comes and goes.
GOODPUT_SCENARIOS = (*SCENARIO_NAMES, "intermittent")
STRAGGLER_FACTOR = 3.0
BIMODAL_FACTOR = 2.0
HICCUP_FACTOR = 4.0
HICCUPS = 4  # transient: this many hiccups, one rank each, spread over the run

# The policy settings of examples/quickstart.yaml: evaluate every 2 s, act after 2 intervals.
POLICY: dict[str, Any] = {
    "intervalSeconds": 2,
    "persistenceIntervals": 2,
    "cooldownSeconds": 10,
    "allowedActions": ["switchMode", "rebalance"],
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One size for every run of a benchmark invocation."""

    workers: int = 4
    steps: int = 1200
    batch_size: int = 32
    learning_rate: float = 0.1
    compute_seconds: float = 0.05
    jitter: float = 0.05
    seed: int = 0
    policy: dict[str, Any] = field(default_factory=lambda: dict(POLICY))
    model: str = "mlp"
    dataset: str = "synthetic"
    evaluation: dict[str, Any] | None = None  # camelCase training.evaluation; the trainer's default when None
    # A user's training code (`training.task: "module:function"`) instead of model/dataset/learningRate:
    # the task builds its model, data, loss and optimizer; `code_dirs` (repository-relative) go on the
    # workers' PYTHONPATH so it imports, in every system.
    task: str | None = None
    code_dirs: tuple[str, ...] = ()
    lr_scaling: str | None = None  # training.lrScaling; the trainer's default (linear) when None
    lr_policy: dict[str, Any] | None = None  # camelCase training.lrPolicy
    # The world size the task's learning rate is meant for when it is not `workers` (ddp-drop runs
    # a task's optimizer on N-1 workers: the job's lrScaling rule then scales it as SGDJob would).
    reference_workers: int | None = None
    # Real slow ranks instead of the sleep (bench.real_cpu): CPUs of a rank of factor 1; None: emulated.
    real_cpu: float | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    slowdowns: tuple[dict[str, Any], ...]  # camelCase SpeedChange documents (rank-based)
    # Groups for the static hierarchical run: the steady speed classes (what a user who knows the
    # fleet writes, one group per accelerator type), or one worker per group (periodic model
    # averaging) where there are no classes to group by.
    groups: tuple[tuple[int, ...], ...]


def build_scenario(name: str, cfg: BenchConfig) -> Scenario:
    n, steps = cfg.workers, cfg.steps
    if n < 2:
        raise ValueError("the benchmark needs at least 2 workers")
    singletons = tuple((r,) for r in range(n))
    if name == "homogeneous":
        return Scenario(name, "all workers equally fast", (), singletons)
    if name == "one-straggler":
        last = n - 1
        fast = tuple(range(last))
        return Scenario(
            name,
            f"rank {last} is {STRAGGLER_FACTOR:g}x slower for the whole run",
            ({"rank": last, "factor": STRAGGLER_FACTOR},),
            (fast, (last,)),
        )
    if name == "bimodal":
        half = n // 2
        slow = tuple(range(n - half, n))
        return Scenario(
            name,
            f"ranks {slow[0]}..{slow[-1]} (half the workers) are {BIMODAL_FACTOR:g}x slower for the whole run",
            tuple({"rank": r, "factor": BIMODAL_FACTOR} for r in slow),
            (tuple(range(n - half)), slow),
        )
    if name == "transient":
        length = max(3, steps // 20)
        hiccups = []
        for k in range(HICCUPS):
            start = int(steps * (0.15 + 0.2 * k))
            hiccups.append({"rank": k % n, "factor": HICCUP_FACTOR, "startStep": start, "endStep": start + length})
        return Scenario(
            name,
            f"{HICCUPS} hiccups of {length} steps, {HICCUP_FACTOR:g}x slower, each on one rank (round robin), "
            "at 15/35/55/75% of the run",
            tuple(hiccups),
            singletons,
        )
    if name == "intermittent":
        last = n - 1
        spells = ((steps // 4, steps // 2), (3 * steps // 4, steps))
        return Scenario(
            name,
            f"rank {last} is {STRAGGLER_FACTOR:g}x slower during steps {spells[0][0]}-{spells[0][1]} and "
            f"{spells[1][0]}-{spells[1][1]} (comes and goes), as fast as the others in between",
            tuple({"rank": last, "factor": STRAGGLER_FACTOR, "startStep": a, "endStep": b} for a, b in spells),
            (tuple(range(last)), (last,)),
        )
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(GOODPUT_SCENARIOS)}")


def emulation(cfg: BenchConfig, scenario: Scenario) -> dict[str, Any]:
    """The `training.emulation` document of every run of the scenario (no sleep with --real-cpu: the
    ranks' real CPU quotas make them unequal, bench.real_cpu)."""
    if cfg.real_cpu is not None:
        return {"computeSeconds": 0.0, "jitter": 0.0, "slowdowns": []}
    return {
        "computeSeconds": cfg.compute_seconds,
        "jitter": cfg.jitter,
        "slowdowns": [dict(s) for s in scenario.slowdowns],
    }


def training(cfg: BenchConfig, scenario: Scenario, *, hierarchical_groups: bool) -> dict[str, Any]:
    what: dict[str, Any] = (
        {"task": cfg.task}
        if cfg.task is not None
        else {"model": cfg.model, "dataset": cfg.dataset, "learningRate": cfg.learning_rate}
    )
    doc: dict[str, Any] = {
        **what,
        "batchSize": cfg.batch_size,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "emulation": emulation(cfg, scenario),
    }
    if cfg.lr_scaling is not None:
        doc["lrScaling"] = cfg.lr_scaling
    if cfg.lr_policy is not None:
        doc["lrPolicy"] = dict(cfg.lr_policy)
    if cfg.evaluation is not None:
        doc["evaluation"] = dict(cfg.evaluation)
    if hierarchical_groups:
        doc["hierarchical"] = {"groups": [list(g) for g in scenario.groups]}
    return doc


def job_doc(
    cfg: BenchConfig, scenario: Scenario, mode: str, rank_batches: Sequence[int] | None = None
) -> dict[str, Any]:
    """The SGDJob `sgdjob run` starts: one node of `workers` worker processes under one torchrun
    agent, the DDP baseline's layout (`torchrun --standalone --nproc-per-node=N`), so both pay the
    same launcher and no system has processes on the two cores that another has not. The workers
    are fixed (the policy may switch modes and rebalance, not replace or rescale), and
    minReplicas = replicas, so the learning rate is used unscaled, as the DDP baseline uses it.
    `rank_batches`: a static split of sync's step from step 0 (training.rankBatchSizes, lb-bsp)."""
    extra = {"rankBatchSizes": list(rank_batches)} if rank_batches is not None else {}
    return {
        "apiVersion": "sgdjob.dev/v1alpha1",
        "kind": "SGDJob",
        "metadata": {"name": f"bench-{scenario.name}-{mode}"},
        "spec": {
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 1,
            "nprocPerNode": cfg.workers,
            "mode": mode,
            "training": training(cfg, scenario, hierarchical_groups=mode == "hierarchical") | extra,
            "policy": dict(cfg.policy),
        },
    }


def ddp_run_config(cfg: BenchConfig, scenario: Scenario) -> dict[str, Any]:
    """The run-config file bench.ddp_baseline reads (`--config`)."""
    return {
        "jobName": f"bench-{scenario.name}-ddp",
        "mode": "sync",
        "referenceWorldSize": cfg.reference_workers or cfg.workers,
        "training": training(cfg, scenario, hierarchical_groups=False),
    }


def rank_factor(slowdowns: tuple[dict[str, Any], ...], rank: int, step: int) -> float:
    """The emulator's rule: the product of every slowdown of `rank` active at `step`."""
    result = 1.0
    for s in slowdowns:
        end = s.get("endStep")
        if s.get("rank") == rank and int(s.get("startStep", 0)) <= step and (end is None or step < int(end)):
            result *= float(s["factor"])
    return result


def rank_speeds(cfg: BenchConfig, scenario: Scenario) -> list[float]:
    """Each rank's samples/s when never waiting, from the emulation config over the run's steps."""
    speeds = []
    for rank in range(cfg.workers):
        seconds = sum(cfg.compute_seconds * rank_factor(scenario.slowdowns, rank, step) for step in range(cfg.steps))
        speeds.append(cfg.steps * cfg.batch_size / seconds if seconds > 0 else 0.0)
    return speeds


def bound(cfg: BenchConfig, scenario: Scenario) -> float:
    return sum(rank_speeds(cfg, scenario))


def slowest_rank(cfg: BenchConfig, scenario: Scenario) -> int:
    """The rank with the lowest emulated speed over the run (the last of equals)."""
    speeds = rank_speeds(cfg, scenario)
    return min(range(cfg.workers), key=lambda r: (round(speeds[r], 6), -r))


def without_rank(cfg: BenchConfig, scenario: Scenario, drop: int) -> tuple[BenchConfig, Scenario]:
    """The same job on the other N-1 workers, as a user who takes a slow worker out by hand runs it:
    the same batch per worker (so the global batch shrinks by 1/N) and the learning rate by the
    job's rule for a smaller world (lrScaling linear: x (N-1)/N; a task's optimizer by its
    lrScaling); rank numbers above `drop` shift down by one, and the dropped rank's slowdowns go
    with it."""
    n = cfg.workers
    if not 0 <= drop < n or n < 2:
        raise ValueError(f"cannot drop rank {drop} of {n} workers (at least 1 must remain)")
    slowdowns = tuple(
        {**s, "rank": s["rank"] - (1 if s["rank"] > drop else 0)} for s in scenario.slowdowns if s["rank"] != drop
    )
    if cfg.task is None:
        smaller = replace(cfg, workers=n - 1, learning_rate=cfg.learning_rate * (n - 1) / n)
    else:  # the task's optimizer sets the rate: the baseline applies the job's rule for N-1 of N
        smaller = replace(cfg, workers=n - 1, reference_workers=n)
    rest = [r - (1 if r > drop else 0) for r in range(n) if r != drop]
    return smaller, Scenario(
        scenario.name, f"{scenario.description}; rank {drop} dropped", slowdowns, tuple((r,) for r in rest)
    )
