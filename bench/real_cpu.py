"""`--real-cpu CPUS`: a benchmark scenario with real slow ranks instead of the emulated sleep. Each rank
runs in a cgroup of its own with a real CPU quota (local.cpulimit): CPUS for a rank of factor 1 and
CPUS / factor for a slower one (one-straggler: the last rank at a third). Nothing sleeps; every
system (DDP, ddp-drop, lb-bsp, sgdjob's modes) runs the same task under the same quotas.

The benchmark's layout is one launcher of N worker processes (`torchrun --nproc-per-node=N` for DDP,
one agent of N workers for sgdjob), so a quota per agent cannot tell the ranks apart: each worker
joins its rank's group itself, by starting through this module (`python -m bench.real_cpu`, which
joins `$SGDJOB_BENCH_CPU_GROUPS/rank-$RANK` and then runs `$SGDJOB_BENCH_TARGET` as `__main__`).
Only scenarios whose factors hold for the whole run qualify (homogeneous, one-straggler, bimodal).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bench.scenarios import BenchConfig, Scenario, rank_factor

ENV_GROUPS = "SGDJOB_BENCH_CPU_GROUPS"
ENV_TARGET = "SGDJOB_BENCH_TARGET"
MODULE = "bench.real_cpu"
NO_SLEEP: dict[str, Any] = {"computeSeconds": 0.0, "jitter": 0.0, "slowdowns": []}


def rank_limits(cfg: BenchConfig, scenario: Scenario, cpus: float) -> dict[str, float]:
    """rank-<r> -> CPUs: `cpus` over the rank's slowdown factor, which must hold for the whole run."""
    if not cpus > 0:
        raise ValueError(f"--real-cpu must be > 0 CPUs, got {cpus}")
    out = {}
    for rank in range(cfg.workers):
        factors = {rank_factor(scenario.slowdowns, rank, step) for step in range(cfg.steps)}
        if len(factors) != 1:
            raise ValueError(
                f"--real-cpu: scenario {scenario.name} changes rank {rank}'s speed during the run; "
                "real CPU quotas are fixed per run (use homogeneous, one-straggler or bimodal)"
            )
        out[f"rank-{rank}"] = cpus / factors.pop()
    return out


@contextlib.contextmanager
def rank_groups(cfg: BenchConfig, scenario: Scenario, target: str) -> Iterator[dict[str, str]]:
    """The run's per-rank groups while the run lasts, and the environment that makes each worker
    join its rank's group before it runs `target`; set in os.environ too (the local runner's
    workers inherit it). Removed afterwards, whatever happened."""
    from sgdjob_operator.local.cpulimit import CpuLimits

    assert cfg.real_cpu is not None
    groups = CpuLimits.create(f"bench-{scenario.name}", rank_limits(cfg, scenario, cfg.real_cpu))
    env = {ENV_GROUPS: str(groups.parent), ENV_TARGET: target}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        groups.remove()


def describe(limits: Mapping[str, float]) -> str:
    shown = ", ".join(f"{rank} {cpus:g}" for rank, cpus in limits.items())
    return f"REAL CPU quotas per rank (cgroup, no sleep): {shown} CPU"


def main() -> None:
    """Join this rank's group, then run the target module with this process's arguments."""
    from sgdjob_operator.local.cpulimit import join_cgroup

    join_cgroup(str(Path(os.environ[ENV_GROUPS]) / f"rank-{os.environ['RANK']}" / "cgroup.procs"))
    target = os.environ[ENV_TARGET]
    sys.argv = [target, *sys.argv[1:]]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
