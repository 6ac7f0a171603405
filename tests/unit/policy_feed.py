"""Scrapes of a simulated synchronous job, for tests of the decision driver and its shells."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.policy import WorkerSample

INTERVAL = 10.0
# 1.5x slower than the median (stragglerThreshold): a split gains +38 %, under splits.FAST_GAIN, so it
# waits out persistenceIntervals.
STRAGGLER = [100.0, 100.0, 100.0, 66.0]


def spec_for(**extra: Any) -> SGDJobSpec:
    policy = {"intervalSeconds": INTERVAL, "persistenceIntervals": 3, "cooldownSeconds": 60, **extra.pop("policy", {})}
    base = {
        "replicas": 4,
        "minReplicas": 3,
        "maxReplicas": 4,
        "mode": "auto",
        "training": {"batchSize": 32},
        "policy": policy,
    }
    return SGDJobSpec.model_validate({**base, **extra})


def feed(plan: Sequence[Sequence[float]], batch: int = 32) -> list[tuple[float, list[WorkerSample]]]:
    """Cumulative counters of a synchronous job, one scrape per interval, at each interval's
    per-rank speeds (samples/s): everyone waits for the slowest rank."""
    n = len(plan[0])
    steps, compute, wait = [0] * n, [0.0] * n, [0.0] * n
    out = []
    for i, speeds in enumerate(plan):
        if i:
            cost = [batch / v for v in speeds]
            wall = max(cost) + 0.01
            k = int(INTERVAL / wall)
            for r in range(n):
                steps[r] += k
                compute[r] += k * cost[r]
                wait[r] += k * (wall - cost[r])
        t = i * INTERVAL
        out.append(
            (
                t,
                [
                    WorkerSample(
                        rank=r,
                        time=t,
                        steps=steps[r],
                        samples=steps[r] * batch,
                        compute_seconds=compute[r],
                        comm_wait_seconds=wait[r],
                        mode="sync",
                        batch_size=batch,
                        node=f"node-{r}",
                        pod=f"job-worker-{r}",
                        world_size=n,
                    )
                    for r in range(n)
                ],
            )
        )
    return out


Scrapes = list[tuple[float, list[WorkerSample]]]
