"""policy.measure: a rank's first window runs from its process's training start when the sample dates it."""

from __future__ import annotations

import dataclasses

import pytest

from sgdjob_operator.policy.measure import FirstWindow, measure, next_rank_states
from sgdjob_operator.policy.samples import WorkerSample
from sgdjob_operator.policy.state import RankState

INTERVAL = 10.0
FIRST = FirstWindow.for_interval(INTERVAL)


def sample(
    rank: int = 0,
    time: float = 100.0,
    steps: int = 40,
    compute: float = 8.0,
    trained: float | None = None,
    node: str = "node-0",
) -> WorkerSample:
    """A sync rank with `steps` steps of 32 samples, `compute` seconds of compute and 1 s of wait."""
    return WorkerSample(
        rank=rank,
        time=time,
        steps=steps,
        samples=32 * steps,
        compute_seconds=compute,
        comm_wait_seconds=1.0,
        mode="sync",
        batch_size=32,
        node=node,
        training_seconds=trained,
    )


def test_first_scrape_with_a_training_start_is_measured_from_that_start() -> None:
    window = measure({}, [sample(time=100.0, steps=40, compute=8.0, trained=9.5)], 1, FIRST)
    assert window.baseline == () and window.restarted == () and window.from_start == (0,)
    w = window.ranks[0]
    assert (w.seconds, w.steps, w.samples) == (9.5, 40, 1280)
    assert (w.compute, w.wait) == (8.0, 1.0)
    assert w.speed == pytest.approx(1280 / 8.0)


def test_first_scrape_without_a_start_is_a_baseline_as_before() -> None:
    for first in (FIRST, None):
        window = measure({}, [sample(trained=None)], 1, first)
        assert window.baseline == (0,) and window.ranks == {} and window.from_start == ()
    # A start is used only when the caller says how long a first window may be.
    assert measure({}, [sample(trained=9.5)], 1).baseline == (0,)


@pytest.mark.parametrize("trained", [0.0, 4.9, 20.1, 3600.0])
def test_a_first_window_too_short_or_too_long_is_a_baseline(trained: float) -> None:
    # Under half an interval: a few steps' jitter would weigh like an interval's. Over two
    # intervals: the rank trained long before the policy saw it (e.g. its state was dropped).
    window = measure({}, [sample(trained=trained)], 1, FIRST)
    assert window.baseline == (0,) and window.ranks == {}


def test_a_started_rank_without_a_step_yet_is_idle_not_slow() -> None:
    window = measure({}, [sample(steps=0, compute=0.0, trained=6.0)], 1, FIRST)
    assert window.ranks == {} and window.idle == (0,) and window.from_start == (0,)


def test_a_restart_is_measured_from_the_new_process_start() -> None:
    prev = {0: RankState(90.0, 500, 16000, 100.0, 10.0, "node-0", speed=160.0, streak=2, flagged=True)}
    window = measure(prev, [sample(time=100.0, steps=30, compute=6.0, trained=8.0)], 1, FIRST)
    assert window.restarted == (0,) and window.from_start == (0,)
    assert (window.ranks[0].seconds, window.ranks[0].steps) == (8.0, 30)
    # Without a start the restart gets no rate this window, as before.
    old = measure(prev, [sample(time=100.0, steps=30, compute=6.0, trained=None)], 1, FIRST)
    assert old.restarted == (0,) and old.ranks == {} and old.from_start == ()


def test_a_process_that_began_after_the_last_sample_restarted_even_with_higher_counters() -> None:
    # Counters went up, yet the process began training 5 s ago, after the last sample (10 s ago):
    # the old counters belong to another process, and differencing them would be nonsense.
    prev = {0: RankState(90.0, 20, 640, 4.0, 0.5, "node-0")}
    window = measure(prev, [sample(time=100.0, steps=30, compute=6.0, trained=5.0)], 1, FIRST)
    assert window.restarted == (0,) and window.ranks[0].steps == 30 and window.ranks[0].seconds == 5.0
    # The same counters from a process that began before the last sample: an ordinary window.
    same = measure(prev, [sample(time=100.0, steps=30, compute=6.0, trained=15.0)], 1, FIRST)
    assert same.restarted == () and same.from_start == () and same.ranks[0].steps == 10


def test_a_baseline_taken_before_training_began_still_starts_the_next_window() -> None:
    # The first scrape came before the process's first step (zeros); it began 4 s later.
    prev = {0: RankState(90.0, 0, 0, 0.0, 0.0, "node-0")}
    window = measure(prev, [sample(time=100.0, trained=6.0)], 1, FIRST)
    assert window.restarted == () and window.from_start == ()
    assert (window.ranks[0].seconds, window.ranks[0].steps) == (10.0, 40)


def test_a_new_worker_measured_from_its_start_begins_its_own_streak() -> None:
    prev = {0: RankState(90.0, 500, 16000, 100.0, 10.0, "node-old", speed=50.0, streak=4, flagged=True)}
    moved = sample(time=100.0, steps=30, compute=6.0, trained=8.0, node="node-new")
    window = measure(prev, [moved], 1, FIRST)
    assert window.restarted == (0,) and 0 in window.ranks
    state = next_rank_states(prev, window, {0: (window.ranks[0].speed, True, None)})[0]
    assert (state.streak, state.flagged, state.node) == (1, True, "node-new")
    # A restart on the same node is the same worker: its streak goes on.
    same = measure(prev, [dataclasses.replace(moved, node="node-old")], 1, FIRST)
    assert next_rank_states(prev, same, {0: (same.ranks[0].speed, True, None)})[0].streak == 5
    # A first-seen rank measured at once has no previous state at all.
    fresh = measure({}, [moved], 1, FIRST)
    assert next_rank_states({}, fresh, {0: (fresh.ranks[0].speed, False, None)})[0].streak == 0


def test_the_first_window_is_dated_by_the_sample_time_not_another_clock() -> None:
    # The trainer's clock may be hours off: only its own elapsed seconds are used, with the
    # shell's sample time, so the window is what the trainer measured.
    window = measure({}, [sample(time=1e9, trained=12.25)], 1, FIRST)
    assert window.ranks[0].seconds == 12.25
    state = next_rank_states({}, window, {0: (window.ranks[0].speed, False, None)})[0]
    assert state.time == 1e9 and state.steps == 40
