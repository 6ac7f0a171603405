"""Reasons are read by people (Events, report.json, kubectl describe): never 'inf' or 'nan' in them."""

from __future__ import annotations

import re

import pytest

from sgdjob_operator.policy.engine import gain_text
from tests.unit.test_policy_harness import Harness

NOT_A_NUMBER = re.compile(r"\b(inf|nan)\b|inf%|nan%", re.IGNORECASE)


def test_a_gain_over_nothing_is_said_in_words() -> None:
    assert gain_text(0.514) == "+51%" and gain_text(-0.02) == "-2%"
    assert gain_text(float("inf")) == "no useful progress measured now"
    assert gain_text(float("nan")) == "gain unknown"


@pytest.mark.parametrize(
    "speeds",
    [
        [100.0, 100.0, 100.0, 1e-6],  # a rank that all but stopped
        [1e-6] * 4,  # nothing moves
        [100.0, 1e-9],
        [5000.0, 5000.0, 1.0, 1.0],
    ],
)
def test_no_reason_prints_inf_or_nan_on_degenerate_fleets(speeds: list[float]) -> None:
    for mode in ("auto", "sync"):
        h = Harness(list(speeds), mode=mode, noise=0.01)
        for _ in range(8):
            h.step()
        h.step([100.0] * len(speeds))  # and back to an equal fleet
        for e in h.history:
            assert not NOT_A_NUMBER.search(e.decision.reason), e.decision.reason
