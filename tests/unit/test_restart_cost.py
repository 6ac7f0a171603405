"""The job's own restart cost (k8s.restart_cost): measured from its creation, then from each
membership change, a shrink's apart from the rest, and what it changes in the policy's choice of a
rescale."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sgdjob_operator.api.models import ControllerState
from sgdjob_operator.k8s.restart_cost import (
    RESTART_GUESS_SECONDS,
    job_shrink_estimate,
    measure_restart,
    restart_began,
    restart_estimate,
)
from sgdjob_operator.policy import Rescale, WorkerSample
from sgdjob_operator.policy.restart import SHRINK_FIXED_SECONDS, shrink_estimate, world_began
from tests.unit.test_policy_harness import Harness


def sample(rank: int, world: int, time: float, trained: float | None) -> WorkerSample:
    return WorkerSample(
        rank=rank, time=time, steps=10, samples=320, compute_seconds=1.0, comm_wait_seconds=0.1, mode="sync",
        batch_size=32, world_size=world, training_seconds=trained,
    )  # fmt: skip


def test_the_world_began_when_its_last_rank_did_and_only_once_every_rank_says() -> None:
    assert world_began([sample(0, 2, 100.0, 30.0), sample(1, 2, 100.0, 25.0)]) == 75.0
    assert world_began([sample(0, 2, 100.0, 30.0)]) is None  # rank 1 not heard yet
    assert world_began([sample(0, 2, 100.0, 30.0), sample(1, 2, 100.0, None)]) is None  # an older trainer


def test_the_first_start_is_measured_from_the_jobs_creation_then_each_restart_from_its_change() -> None:
    ctl = ControllerState()
    assert restart_estimate(ctl) == RESTART_GUESS_SECONDS
    measure_restart(ctl, [sample(0, 3, 50.0, 5.0), sample(1, 3, 50.0, 6.0), sample(2, 3, 50.0, 4.0)], created=30.0)
    assert restart_estimate(ctl) == pytest.approx(16.0)  # the last rank began at 46
    # Later scrapes of the same world change nothing: the first start is measured once.
    measure_restart(ctl, [sample(0, 3, 90.0, 45.0), sample(1, 3, 90.0, 40.0), sample(2, 3, 90.0, 44.0)], created=30.0)
    assert restart_estimate(ctl) == pytest.approx(16.0)
    restart_began(ctl, 100.0)  # a rescale to 4 (a new pod)
    old_world = [sample(0, 3, 101.0, 55.0), sample(1, 3, 101.0, 50.0), sample(2, 3, 101.0, 54.0)]
    measure_restart(ctl, old_world, created=30.0)
    assert ctl.restart_from is not None  # the old world, scraped before it stopped: still waiting
    measure_restart(ctl, [sample(0, 2, 110.0, 2.5), sample(1, 2, 110.0, 2.0)], created=30.0)
    assert restart_estimate(ctl) == pytest.approx(8.0) and ctl.restart_from is None  # rank 1 began at 108


# The real-node benchmark's slow fleet (0.8, 0.8 and 0.27 CPU): the slow rank steps 44 ms whatever its
# batch. At the benchmark's settings (0.5-s interval, 10-s cooldown) a change must repay its pause
# within 15 s: dropping the rank gains ~+50 % over the best split, which repays a measured 8-s restart
# and never the 60-s guess.
def test_a_shrink_is_measured_apart_and_until_then_costs_at_most_the_guess() -> None:
    ctl = ControllerState()
    world = [sample(r, 3, 50.0, 5.0) for r in range(3)]
    measure_restart(ctl, world, created=25.0)  # a slow first start: 20 s
    assert restart_estimate(ctl) == pytest.approx(20.0)
    assert job_shrink_estimate(ctl) == SHRINK_FIXED_SECONDS  # no pod starts in a shrink
    restart_began(ctl, 100.0, shrink=True)
    measure_restart(ctl, [sample(0, 2, 110.0, 6.5), sample(1, 2, 110.0, 6.0)], created=25.0)
    assert job_shrink_estimate(ctl) == pytest.approx(4.0) and restart_estimate(ctl) == pytest.approx(20.0)
    restart_began(ctl, 200.0)  # a replacement: a pod starts
    measure_restart(ctl, [sample(r, 2, 230.0, 5.0) for r in range(2)], created=25.0)
    assert restart_estimate(ctl) == pytest.approx(25.0) and job_shrink_estimate(ctl) == pytest.approx(4.0)
    fast = ControllerState()
    measure_restart(fast, world, created=44.0)  # a first start of 1 s (an image on the node, a tiny job)
    assert job_shrink_estimate(fast) == pytest.approx(1.0), "never more than a whole start"


def bench_like(
    restart_s: float,
    shrink_s: float | None = None,
    speeds: tuple[float, ...] = (1 / 0.00055, 1 / 0.00055, 1 / 0.0006),
    fixed: tuple[float, ...] = (0.002, 0.002, 0.044),
) -> Harness:
    """The real-node benchmark's slow fleet at its settings (0.5-s interval, 10-s cooldown)."""
    return Harness(
        list(speeds),
        mode="sync",
        fixed=list(fixed),
        policy={
            "intervalSeconds": 0.5, "persistenceIntervals": 2, "cooldownSeconds": 10,
            "allowedActions": ["rebalance", "rescale"],
        },
        restart_seconds=restart_s,
        shrink_seconds=shrink_s,
    )  # fmt: skip


def shrinks(h: Harness) -> list[Rescale]:
    """The rescales that removed ranks (the harness grows a shrunk job back after the cooldown, onto a
    node as slow as the one it left)."""
    return [e.decision for e in h.changes() if isinstance(e.decision, Rescale) and e.decision.remove_ranks]


def test_a_measured_short_restart_lets_the_policy_drop_a_rank_the_guess_would_keep() -> None:
    measured, guessed = bench_like(8.0), bench_like(RESTART_GUESS_SECONDS)
    for _ in range(40):
        measured.step()
        guessed.step()
    dropped = shrinks(measured)
    assert len(dropped) == 1 and dropped[0].remove_ranks == (2,), [e.decision.reason for e in measured.changes()]
    assert not [e for e in guessed.changes() if isinstance(e.decision, Rescale)]


def test_a_rescale_down_is_weighed_by_the_shrink_not_by_a_whole_start() -> None:
    """The real slow fleet's first start took ~20 s (the 0.27-CPU node importing torch): weighed by
    that, dropping the node never repays; a shrink starts nothing, and weighed by its own 4 s it does."""
    by_start, by_shrink = bench_like(20.0), bench_like(20.0, shrink_s=4.0)
    for _ in range(40):
        by_start.step()
        by_shrink.step()
    assert not [e for e in by_start.changes() if isinstance(e.decision, Rescale)]
    dropped = shrinks(by_shrink)
    assert len(dropped) == 1 and dropped[0].remove_ranks == (2,), [e.decision.reason for e in by_shrink.changes()]


def test_a_shrink_of_a_larger_model_is_guessed_to_pause_longer_until_one_is_measured() -> None:
    # The checkpoint is written and read back with the optimizer's moments: 3x the gradient each way.
    small = [sample(r, 3, 50.0, 5.0) for r in range(3)]
    large = [replace(s, gradient_bytes=500_000_000) for s in small]  # a 125M-parameter fp32 model
    assert shrink_estimate(None, 60.0, small) == SHRINK_FIXED_SECONDS
    assert shrink_estimate(None, 60.0, large) == pytest.approx(SHRINK_FIXED_SECONDS + 30.0)
    assert shrink_estimate(None, 20.0, large) == 20.0, "never more than a whole start"
    assert shrink_estimate(2.5, 60.0, large) == 2.5, "a measured shrink is the job's own figure"
