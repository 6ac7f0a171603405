"""The margin a new split of sync's batch needs shrinks as its speeds' measured error does
(splits.split_margin, state.SpeedEstimate.error): a split one sample off, worth ~2 %, is corrected once
the windows show the speeds are known that well, and not while they are not."""

from __future__ import annotations

import math
import re

import pytest

from sgdjob_operator.policy import Rebalance
from sgdjob_operator.policy.speeds import running_speed
from sgdjob_operator.policy.splits import RESPLIT_FLOOR, RESPLIT_MARGIN
from sgdjob_operator.policy.state import PolicyState, RankState, SpeedEstimate
from tests.unit.test_policy_harness import Harness
from tests.unit.test_policy_speeds import DEPARTURE, window

SPLIT_ONLY = {"allowedActions": ["rebalance"]}
# A 2x slower pair that a first split misread: 42/42/22/22 where 43/43/21/21 is right. Steps: 0.22 s
# (the slow pair's 22 samples at 100/s) against 0.215 s (the fast pair's 43 at 200/s): +2.3 %.
PAIR = [200.0, 200.0, 100.0, 100.0]
OFF_BY_ONE = {0: 42, 1: 42, 2: 22, 3: 22}
RIGHT = {0: 43, 1: 43, 2: 21, 3: 21}


def test_the_error_comes_from_the_spread_of_the_windows_and_needs_four_of_them() -> None:
    est = None
    speeds = [100.0, 104.0, 96.0, 100.0, 102.0]
    for i, v in enumerate(speeds):
        _, est = running_speed(est, window(v), False, DEPARTURE)
        assert est is not None
        if i < 4:  # four windows decay to 3.4 windows' worth
            assert est.error is None, "a spread of fewer than four windows says little"
    assert est is not None and est.error is not None
    # About the windows' standard deviation over sqrt(windows - 1).
    logs = [math.log(v) for v in speeds]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert est.error == pytest.approx(sd / math.sqrt(len(logs) - 1), rel=0.2)
    _, steady = running_speed(None, window(100.0), False, DEPARTURE)
    for _ in range(5):
        _, steady = running_speed(steady, window(100.0), False, DEPARTURE)
    assert steady is not None and steady.error == pytest.approx(0.0, abs=1e-9)


def test_the_window_spread_survives_the_policy_state() -> None:
    est = SpeedEstimate(3200.0, 32.0, 100.0, 32, "sync", 0, 0.0, 5.0, 23.0, 105.9)
    state = PolicyState(ranks={0: RankState(1.0, 100, 3200, 32.0, 1.0, "n", 100.0, 0, False, est)})
    again = PolicyState.from_dict(state.to_dict()).ranks[0].estimate
    assert again == est


def test_a_split_one_sample_off_is_corrected_once_the_speeds_are_known_well_enough() -> None:
    h = Harness(PAIR, policy=SPLIT_ONLY, start_batches=OFF_BY_ONE, noise=0.004)
    for _ in range(12):
        h.step()
    changes = h.changes()
    assert len(changes) == 1, [e.decision.reason for e in changes]
    d = changes[0].decision
    assert isinstance(d, Rebalance) and d.batch_sizes == RIGHT
    assert d.predicted_gain is not None and RESPLIT_FLOOR <= d.predicted_gain < RESPLIT_MARGIN
    # Made on measured errors, not on the flat margin: the windows before it said "needs +3%".
    index = h.history.index(changes[0])
    assert "(margin +1.5%)" in d.reason or "(margin +2" in d.reason
    assert any("needs +3%" in e.decision.reason for e in h.history[:index])


def test_noisy_windows_keep_the_full_margin_and_raise_it_by_their_noise() -> None:
    # 8 % noise per window: each speed's measured error stays above 1 %, so the settled margin stays at
    # its cap, where the windows' speeds alone would have claimed a precision of hundreds of steps; and
    # the windows' spikes (state.SpeedEstimate.noise) raise it further, so the +2 % split is not made.
    h = Harness(PAIR, policy=SPLIT_ONLY, start_batches=OFF_BY_ONE, noise=0.08, seed=3)
    for _ in range(12):
        h.step()
    margins = [float(m) for e in h.history for m in re.findall(r"(?:needs|margin) \+([0-9.]+)%", e.decision.reason)]
    assert 3.0 in margins, "no window compared a settled split against its margin"
    assert min(margins) == 3.0, margins
    assert any("window noise" in e.decision.reason for e in h.history), "the noise never raised the margin"
    assert not h.changes()
