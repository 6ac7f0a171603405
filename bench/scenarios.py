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

# The goodput benchmark's two scenario sets (issue #37, "held-out evaluation"). TUNING: the five
# scenarios above, on 4 workers, which every policy constant fitted by a benchmark run was fitted on
# (seeds 0-2 in every full run; subsets went up to 10 seeds, 0-9: bench/HISTORY.md). HELDOUT: other
# worker counts, other factors, a straggler that appears mid-run and two speed classes, on seeds the
# tuning never used. Nothing may be fitted on the held-out set.
TUNING = "tuning"
HELDOUT = "heldout"
TUNING_SEEDS_USED = range(10)
HELDOUT_SEED_BASE = 100
HELDOUT_SCENARIOS = ("3w-straggler-2x", "6w-straggler-5x", "8w-two-classes", "4w-late-straggler-3x")
SCENARIO_SETS: dict[str, tuple[str, ...]] = {TUNING: GOODPUT_SCENARIOS, HELDOUT: HELDOUT_SCENARIOS}
SEED_BASES: dict[str, int] = {TUNING: 0, HELDOUT: HELDOUT_SEED_BASE}
# The late straggler appears at this fraction of the run's steps: step 40 of the goodput task's 200,
# 2.5 s into training at the tuning set's homogeneous pace (2041 samples/s of 128 a step: 16 steps/s,
# full run of a417476), about a third of its 8-s budget. By step, not by time, so every system meets
# it at the same step and the lb-bsp split and the bound can be computed from the config.
LATE_START_FRACTION = 0.2


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


@dataclass(frozen=True, slots=True)
class HeldOutShape:
    """What a held-out scenario changes in the task's config: its own worker count, and where the
    run would otherwise be much longer or shorter than the tuning runs, its emulated compute."""

    workers: int
    compute_seconds: float | None  # None: the task's (0.05 s a step for the digits tasks)
    why: str


HELDOUT_SHAPES: dict[str, HeldOutShape] = {
    # A 2x straggler in 3: DDP steps at the straggler's 0.1 s, 20 s for 200 steps (the tuning's
    # one-straggler DDP: 30 s); the global batch is 96, so the target takes more steps than on 4
    # workers (DDP: 0.9 held at 11.4 s, about step 105; sizing run, 1 seed, machine loaded).
    "3w-straggler-2x": HeldOutShape(3, None, "the task's 0.05 s a step"),
    # A 5x straggler in 6: at the task's 0.05 s a step DDP would wait 0.25 s a step, 50 s for 200
    # steps, where the tuning's one-straggler DDP runs 30 s. At 0.03 it waits 0.15 s, the tuning's pace.
    # Real compute is then a larger share of a fast rank's step (sizing run, DDP, machine loaded: 0.169 s
    # a step where the sleep is 0.15, so about 0.02 s on top of a fast rank's 0.03).
    "6w-straggler-5x": HeldOutShape(6, 0.03, "0.03 s a step (not 0.05), so DDP steps at the tuning's 0.15 s"),
    # Two speed classes of 4 (1x and 1.5x) at the task's 0.05 s. 8 processes share the 2 cores, so
    # each step carries more real compute than on 4 workers: the sizing run (DDP at 0.04 s, machine
    # loaded) stepped at 0.093 s where the sleep is 0.06, about 0.03 s on top. A smaller emulated
    # compute would bring the run nearer the tuning's length but leave the classes' 1.5x mostly under
    # that contention; at 0.05 DDP steps at about 0.11 s, 22 s a run.
    "8w-two-classes": HeldOutShape(8, None, "the task's 0.05 s a step; 8 processes on 2 cores add ~0.03 s a step"),
    # The tuning's one-straggler fleet, but the 3x straggler appears at step 40 (LATE_START_FRACTION):
    # the policy has seen the rank fast first, so the fast rule (ranks slow since they began) does not
    # apply, and the split must show persistence first.
    "4w-late-straggler-3x": HeldOutShape(4, None, "the task's 0.05 s a step; the straggler from 20 % of the run"),
}


def scenario_config(name: str, cfg: BenchConfig) -> BenchConfig:
    """The config a scenario runs with: the task's for a tuning scenario, the held-out shape's
    worker count and compute for a held-out one."""
    shape = HELDOUT_SHAPES.get(name)
    if shape is None:
        return cfg
    compute = cfg.compute_seconds if shape.compute_seconds is None else shape.compute_seconds
    return replace(cfg, workers=shape.workers, compute_seconds=compute)


def seeds_of(scenario_set: str, count: int) -> list[int]:
    """The first `count` seeds of a set: 0, 1, ... for the tuning set, 100, 101, ... held out."""
    return [SEED_BASES[scenario_set] + k for k in range(count)]


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
    if name in HELDOUT_SHAPES:
        return build_heldout(name, cfg)
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join((*GOODPUT_SCENARIOS, *HELDOUT_SCENARIOS))}")


def build_heldout(name: str, cfg: BenchConfig) -> Scenario:
    """A held-out scenario on `cfg` (run it on `scenario_config(name, cfg)`, which sets its workers)."""
    n, last = cfg.workers, cfg.workers - 1
    fast = tuple(range(last))
    if name in ("3w-straggler-2x", "6w-straggler-5x"):
        factor = 2.0 if name == "3w-straggler-2x" else 5.0
        return Scenario(
            name,
            f"rank {last} of {n} is {factor:g}x slower for the whole run",
            ({"rank": last, "factor": factor},),
            (fast, (last,)),
        )
    if name == "8w-two-classes":
        half = n // 2
        slow = tuple(range(n - half, n))
        return Scenario(
            name,
            f"two speed classes: ranks 0..{n - half - 1} at 1x, ranks {slow[0]}..{slow[-1]} 1.5x slower, "
            "for the whole run",
            tuple({"rank": r, "factor": 1.5} for r in slow),
            (tuple(range(n - half)), slow),
        )
    if name == "4w-late-straggler-3x":
        start = round(cfg.steps * LATE_START_FRACTION)
        return Scenario(
            name,
            f"rank {last} of {n} becomes {STRAGGLER_FACTOR:g}x slower at step {start} and stays so",
            ({"rank": last, "factor": STRAGGLER_FACTOR, "startStep": start},),
            (fast, (last,)),
        )
    raise ValueError(f"unknown held-out scenario {name!r}; known: {', '.join(HELDOUT_SCENARIOS)}")


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
