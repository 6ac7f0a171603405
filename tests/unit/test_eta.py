"""The ETA both shells show (`policy.eta`): pace from recent steps, the target from the validation trend."""

from __future__ import annotations

import pytest

from sgdjob_operator.policy.eta import Eta, goal, keep_validation, pace, predict, target_step
from sgdjob_trainer.config import Target


def test_pace_is_steps_per_second_and_starts_over_after_a_restart_from_a_checkpoint() -> None:
    assert pace([(0.0, 0), (10.0, 50), (20.0, 100)]) == 5.0
    assert pace([(0.0, 100), (10.0, 150), (20.0, 120), (30.0, 160)]) == 4.0  # resumed at 120
    assert pace([(0.0, 10)]) is None and pace([(0.0, 10), (5.0, 10)]) is None  # nothing moved yet


def test_target_step_carries_the_recent_trend_forward_and_refuses_a_trend_away_from_it() -> None:
    assert target_step([(100, 0.5), (200, 0.6), (300, 0.7)], 0.9, True) == pytest.approx(500)
    assert target_step([(100, 2.0), (200, 1.5)], 1.0, False) == pytest.approx(300)  # a loss falls to it
    assert target_step([(100, 0.7), (200, 0.6)], 0.9, True) is None  # accuracy falling
    assert target_step([(100, 0.6), (200, 0.6)], 0.9, True) is None  # flat
    assert target_step([(100, 0.95)], 0.9, True) == 100  # reached already
    assert target_step([(100, 0.5)], 0.9, True) is None  # one point has no trend


def test_predict_counts_to_the_target_unless_it_lies_past_the_last_step() -> None:
    points = [(0.0, 100), (20.0, 300)]  # 10 steps a second
    trend = [(100, 0.5), (200, 0.6), (300, 0.7)]
    eta = predict(points, 1000, trend, (0.9, True))
    assert eta is not None and eta.basis == "target" and eta.seconds == pytest.approx(20.0)
    assert predict(points, 400, trend, (0.9, True)) == Eta(10.0, "last step")  # step 500 comes after the end
    assert predict(points, 1000, [(100, 0.7), (200, 0.6)], (0.9, True)) == Eta(70.0, "last step")
    assert predict([(0.0, 0)], 1000) is None


def test_eta_text_fits_a_kubectl_column() -> None:
    assert [Eta(s, "target").text for s in (35.4, 250, 7500)] == ["35s", "4m10s", "2h05m"]


def test_the_targets_metric_is_the_one_kept_and_its_direction_follows_the_target() -> None:
    loss = Target(metric="loss", value=0.5)
    assert goal(loss) == (0.5, False) and goal(Target(metric="accuracy", value=0.9)) == (0.9, True)
    assert goal(Target(metric="metric", value=3.0, minimize=True)) == (3.0, False)
    kept = keep_validation([], loss, 100, loss=0.8, accuracy=0.7, metric=None)
    kept = keep_validation(kept, loss, 100, loss=0.8, accuracy=0.7, metric=None)  # the same validation again
    kept = keep_validation(kept, loss, 200, loss=float("nan"), accuracy=0.7, metric=None)  # no number, no point
    assert kept == [(100, 0.8)]
