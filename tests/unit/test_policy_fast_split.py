"""A new split of sync's batch with a very large predicted gain is made on the first window that
shows it (splits.FAST_GAIN) when the slow ranks have been slow since they began; a rank measured at
its normal speed before (a hiccup, or a slowdown that starts mid-run) and everything else still
waits out persistenceIntervals."""

from __future__ import annotations

from sgdjob_operator.policy import Keep, Rebalance, SwitchMode
from sgdjob_operator.policy.splits import FAST_GAIN
from tests.unit.test_policy_harness import Harness

FAST, SLOW = 100.0, 33.0
# What the quickstart and the benchmark allow: no replacement (its gain would be the best).
SPLIT = {"allowedActions": ["switchMode", "rebalance"]}


def run(h: Harness, windows: int) -> None:
    for _ in range(windows):
        h.step()


def changes(h: Harness) -> list[tuple[int, object]]:
    """The harness's changes, each with its window's index."""
    return [(h.history.index(e), e.decision) for e in h.changes()]


def test_a_3x_straggler_present_from_the_start_is_split_on_the_first_window_with_rates() -> None:
    h = Harness([FAST] * 3 + [SLOW], policy=SPLIT, noise=0.02)
    run(h, 8)
    (index, split), *rest = changes(h)
    assert "waiting for rates" in h.history[0].decision.reason
    assert index == 1, "the split waited out persistence"
    assert isinstance(split, Rebalance) and split.predicted_gain >= FAST_GAIN
    assert split.batch_sizes[3] < 16 and sum(split.batch_sizes.values()) == 4 * 32
    assert "made at once" in split.reason
    assert rest == []  # the split holds: nothing flaps after it


def test_a_2x_slower_half_is_split_on_the_first_window_with_rates() -> None:
    h = Harness([FAST, FAST, FAST / 2, FAST / 2], policy=SPLIT, noise=0.02)
    run(h, 8)
    (index, split), *rest = changes(h)
    assert index == 1, "the split waited out persistence"
    assert isinstance(split, Rebalance) and split.predicted_gain >= FAST_GAIN and "made at once" in split.reason
    assert split.batch_sizes[2] == split.batch_sizes[3] < split.batch_sizes[0] == split.batch_sizes[1]
    assert rest == []


def test_a_mildly_slower_rank_still_waits_out_persistence() -> None:
    h = Harness([FAST, FAST, FAST, FAST / 1.5], policy=SPLIT)  # at stragglerThreshold: +37 %
    run(h, 5)
    first = h.history[1].decision
    assert isinstance(first, Keep) and "persisting 1/3 intervals" in first.reason
    (index, split), *_ = changes(h)
    assert index == 3 and isinstance(split, Rebalance)
    assert split.predicted_gain < FAST_GAIN and "made at once" not in split.reason


def test_a_mode_switch_with_a_large_gain_still_waits_out_persistence() -> None:
    # Async allowed, rebalance not: the large gain belongs to a mode switch, which pauses the job.
    h = Harness([FAST] * 3 + [SLOW], policy={"allowedActions": ["switchMode"]}, training={"steps": 100_000})
    run(h, 60)
    switches = [(i, d) for i, d in changes(h) if isinstance(d, SwitchMode)]
    assert switches, "no switch at all: the test no longer exercises the persistence rule"
    index, switch = switches[0]
    streak = [e.decision.reason for e in h.history[index - 2 : index]]
    assert all("persisting" in why for why in streak) and "made at once" not in switch.reason


def test_a_one_window_hiccup_of_a_rank_measured_before_changes_nothing() -> None:
    h = Harness([FAST] * 4, policy=SPLIT, noise=0.02)
    run(h, 3)
    h.speeds[2] = SLOW / 1.3  # a 4x hiccup for one window: the window's mean cannot tell it from a steady 4x
    run(h, 1)
    h.speeds[2] = FAST
    run(h, 8)
    assert changes(h) == []
    assert "persisting 1/3 intervals" in h.history[3].decision.reason


def test_a_straggler_that_appears_mid_run_is_split_once_it_has_persisted_and_the_split_holds() -> None:
    h = Harness([FAST] * 4, policy=SPLIT, noise=0.02)
    run(h, 3)
    h.speeds[2] = SLOW  # slow from here on
    run(h, 8)
    (index, split), *rest = changes(h)
    assert index == 5, "a rank slow since it was measured fast waits out persistence (3 windows)"
    assert isinstance(split, Rebalance) and split.batch_sizes[2] < 16 and "made at once" not in split.reason
    assert rest == []
