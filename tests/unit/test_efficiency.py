"""Statistical efficiency measured from the job's gradients, and how it moves the policy's choice."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sgdjob_operator.api.models import SGDJobSpec
from sgdjob_operator.policy import Rebalance, SwitchMode, WorkerSample, job_view
from sgdjob_operator.policy.efficiency import MIN_STEPS, Efficiency, estimate
from sgdjob_operator.policy.engine import MEASURE_WAIT_STEPS
from sgdjob_operator.policy.samples import GradientSignal
from tests.unit.test_policy_harness import Harness

FAST, SLOW = 100.0, 33.0


def _sample(rank: int, gradient: GradientSignal | None) -> WorkerSample:
    return WorkerSample(rank, 0.0, 10, 320, 1.0, 0.0, "sync", 32, gradient=gradient)


def test_ranks_average_into_one_estimate_once_enough_steps_are_measured() -> None:
    few = GradientSignal(MIN_STEPS - 1, 1.0, 100.0, 0.9)
    assert not estimate([_sample(0, few), _sample(1, None)], 0.02).measured, "too few steps: the prior"
    signals = [GradientSignal(40, 1.0, 80.0, 0.8), GradientSignal(30, 3.0, 320.0, 2.6)]
    eff = estimate([_sample(r, g) for r, g in enumerate(signals)], 0.02, "sqrt")
    assert eff.measured and eff.steps == 40 and eff.ranks == 2, "the figures rest on the best-measured rank's steps"
    assert eff.noise_scale == pytest.approx(100.0) and eff.correlation == pytest.approx(0.85)
    # Near the noise floor (noise scale far above the step's batch) the correlation is noise: not read.
    floor = estimate([_sample(0, GradientSignal(40, 0.01, 80.0, -0.004))], 0.02, global_batch=128)
    assert floor.measured and floor.noise_scale == pytest.approx(8000.0) and floor.correlation is None
    assert floor.stale(2) == pytest.approx(0.96), "staleness falls back to the prior"
    assert "correlation unknown, staleness assumed" in floor.describe()
    assert estimate([_sample(0, GradientSignal(40, 1.0, 200.0, 0.9))], 0.02, global_batch=128).correlation == 0.9
    lost = estimate([_sample(0, GradientSignal(40, -0.5, 80.0, 0.1))], 0.02)
    assert lost.noise_scale == math.inf and lost.correlation is None, "the true gradient is lost in the noise"


def test_an_async_stay_stays_measured_when_its_slow_rank_starts_to_report() -> None:
    """In async a 4x slower rank reaches MIN_STEPS when the fast ranks have ~40 steps: its figures join
    the average, and the stay still counts as measured over the fast ranks' steps (before, the fewest
    steps ruled, the stay fell back below MEASURE_WAIT_STEPS and its check stopped counting windows)."""

    def ranks(slow_steps: int) -> list[WorkerSample]:
        fast = [
            dataclasses.replace(_sample(r, GradientSignal(4 * MIN_STEPS, 1.0, 20.0, 0.9)), mode="async")
            for r in range(3)
        ]
        slow = GradientSignal(slow_steps, 1.0, 40.0, 0.8)
        return [*fast, dataclasses.replace(_sample(3, slow), mode="async")]

    before, after = estimate(ranks(MIN_STEPS - 1), 0.02), estimate(ranks(MIN_STEPS), 0.02)
    assert before.ranks == 3 and after.ranks == 4, "the slow rank's figures count once it has MIN_STEPS"
    assert before.steps == after.steps == 4 * MIN_STEPS >= MEASURE_WAIT_STEPS
    assert after.measured_in == "async" and after.noise_scale == pytest.approx(25.0)


def test_a_stale_gradient_is_worth_the_measured_correlation_per_step_of_age() -> None:
    steady = Efficiency(0.02, noise_scale=200.0, correlation=0.999)
    turning = Efficiency(0.02, noise_scale=200.0, correlation=0.4)
    assert steady.stale(3) == pytest.approx(0.997, abs=1e-3) and turning.stale(3) == pytest.approx(0.064)
    assert Efficiency(0.02, noise_scale=200.0, correlation=-0.5).stale(1) == 0.0, "an oscillating gradient"
    assert Efficiency(0.02).stale(3) == pytest.approx(0.94), "unmeasured: the prior"
    # Per-sample learning rate counts one for one (a world shrunk under a sqrt or none rule).
    assert steady.per_sample(4 / 3) == pytest.approx(4 / 3) and Efficiency(0.02).per_sample(4 / 3) == 1.0
    # Async at the trainer's damping: 1/sqrt(1+s) of the learning rate for a gradient s steps old,
    # which moved the model by about s x (N-1)/N synchronous steps.
    damped = Efficiency(0.02, "sqrt", noise_scale=200.0, correlation=0.9)
    assert damped.async_update(2.0, 4) == pytest.approx(0.9**1.5 / math.sqrt(3))
    assert Efficiency(0.02, "sqrt").async_update(1.0, 4) == pytest.approx(0.98), "the prior ignores it"


def test_an_adaptive_optimizers_smaller_updates_count_less_by_the_measured_noise_scale() -> None:
    """Adam divides its step by the gradients' RMS, sqrt(|G|^2 + tr(S)/b) for b samples: an update over
    a quarter of sync's batch is worth sqrt((1 + Bn/B)/(1 + Bn/b)) per sample."""
    adam = Efficiency(0.02, noise_scale=128.0, correlation=0.99, adaptive=True, reference_batch=128)
    assert adam.batch_worth(32) == pytest.approx(math.sqrt(2 / 5))
    assert adam.batch_worth(128) == 1.0 and adam.batch_worth(256) == 1.0, "never a promised gain"
    quiet = Efficiency(0.02, noise_scale=1.0, correlation=0.99, adaptive=True, reference_batch=128)
    assert quiet.batch_worth(32) == pytest.approx(1.0, abs=0.02), "little noise: Adam's step barely changes"
    lost = Efficiency(0.02, noise_scale=math.inf, adaptive=True, reference_batch=128)
    assert lost.batch_worth(32) == pytest.approx(0.5), "noise-dominated: sqrt(b/B)"
    sgd = Efficiency(0.02, noise_scale=128.0, correlation=0.99, reference_batch=128)
    assert sgd.batch_worth(32) == 1.0, "SGD's step scales with its learning rate per sample"
    assert adam.async_update(1.0, 4) == pytest.approx(0.99**0.75), "staleness only: the shared damping is apart"
    # The ranks' flag reaches the estimate, with sync's global batch as the reference.
    samples = [
        dataclasses.replace(_sample(r, GradientSignal(40, 1.0, 128.0, 0.99)), adaptive_optimizer=r == 0)
        for r in range(2)
    ]
    eff = estimate(samples, 0.02, global_batch=128)
    assert eff.adaptive and eff.reference_batch == 128 and eff.batch_worth(32) == pytest.approx(math.sqrt(2 / 5))
    assert "adaptive optimizer: smaller updates count less" in eff.describe()


def test_a_noisy_adam_job_keeps_sync_where_the_same_sgd_job_goes_async() -> None:
    """The transformer example's case: gradients that barely turn (correlation 0.98) but are noisy
    (Bn about two global batches) under AdamW. Async wins for SGD and not for Adam."""
    sgd = _first_change(_straggler_job(0.98, variance=250.0))
    assert isinstance(sgd, SwitchMode) and sgd.mode == "async", sgd.reason
    adam = _first_change(_straggler_job(0.98, adaptive=True, variance=250.0))
    assert not (isinstance(adam, SwitchMode) and adam.mode == "async"), adam.reason
    assert "adaptive optimizer" in adam.reason and "correlation 0.980" in adam.reason


def test_an_async_job_whose_measured_gradients_start_to_turn_goes_back_to_sync() -> None:
    """The trainers measure the correlation while async runs (gradient_stats): once the gradient turns
    (0.2 per step, as the transformer example's did after its first hundred steps) async's stale
    updates are worth little, and the job goes back to synchronous SGD."""
    d = _first_change(_straggler_job(0.2, start_mode="async"))
    assert isinstance(d, SwitchMode) and d.mode == "sync", d.reason
    assert "correlation 0.200" in d.reason and "steps in async" in d.reason, d.reason
    # Steady gradients keep async against sync over the job's global batch (sqrt lrScaling: a smaller
    # batch is not credited), and under linear with the default actions. Under linear, with trimBatch
    # allowed, the one sync that beats it is the trimmed split, whose smaller global batch the measured
    # noise scale (100 samples) values at 228/206 per sample.
    steady = _straggler_job(0.999, start_mode="async", lr_scaling="sqrt")
    for _ in range(8):
        decision = steady.step().decision
        assert not isinstance(decision, SwitchMode), decision.reason
    steady = _straggler_job(0.999, start_mode="async")
    for _ in range(8):
        decision = steady.step().decision
        assert not isinstance(decision, SwitchMode), decision.reason
    trimmed = _first_change(_straggler_job(0.999, start_mode="async", trim=True))
    assert isinstance(trimmed, SwitchMode) and trimmed.mode == "sync" and trimmed.batch_sizes, trimmed.reason
    assert trimmed.batch_sizes[0] == 32 and sum(trimmed.batch_sizes.values()) < 128, trimmed.batch_sizes
    assert "trimmed sync" in trimmed.reason and "smaller sync batch counts more" in trimmed.reason


@pytest.mark.parametrize("rule, ratio", [("linear", 1.0), ("sqrt", math.sqrt(4 / 3)), ("none", 4 / 3)])
def test_dropping_a_worker_changes_the_per_sample_learning_rate_by_the_jobs_rule(rule: str, ratio: float) -> None:
    spec = SGDJobSpec.model_validate({"replicas": 4, "minReplicas": 3, "training": {"lrScaling": rule}})
    assert job_view(spec).lr_ratio(3) == pytest.approx(ratio)


def _straggler_job(
    correlation: float | None,
    async_capable: bool | None = None,
    adaptive: bool | None = None,
    variance: float = 100.0,
    start_mode: str | None = None,
    steps: int = 50,
    lr_scaling: str = "linear",
    trim: bool = False,
) -> Harness:
    gradient = None if correlation is None else GradientSignal(steps, 1.0, variance, correlation)
    return Harness(
        [FAST, FAST, FAST, SLOW],
        jitter=0.4,
        policy={"allowedActions": ["switchMode", "rebalance", *(["trimBatch"] if trim else [])]},
        training={"async": {"stalenessLr": "none"}, "lrScaling": lr_scaling},
        gradient=gradient,
        async_capable=async_capable,
        adaptive_optimizer=adaptive,
        start_mode=start_mode,
    )


def _first_change(h: Harness) -> SwitchMode | Rebalance:
    for _ in range(8):
        d = h.step().decision
        if isinstance(d, SwitchMode | Rebalance):
            return d
    raise AssertionError(f"no change: {h.history[-1].decision.reason}")


def test_where_staleness_costs_nothing_the_straggler_job_goes_async() -> None:
    d = _first_change(_straggler_job(0.999))
    assert isinstance(d, SwitchMode) and d.mode == "async", d.reason
    assert "measured over 50 steps in sync" in d.reason and "correlation 0.999" in d.reason


def test_a_correlation_of_the_first_steps_sends_no_job_to_a_stale_mode() -> None:
    """The first steps' correlation is near 1 while the loss falls steeply, and drops later: measured
    over fewer than MEASURE_WAIT_STEPS steps it moves no job to async or hierarchical; the fresh
    change (rebalanced sync) is made meanwhile, and the reason says what the stale modes wait for."""
    d = _first_change(_straggler_job(0.999, steps=MEASURE_WAIT_STEPS // 2))
    assert isinstance(d, Rebalance), d.reason
    assert f"stale modes wait for {MEASURE_WAIT_STEPS} steps of measured gradient statistics (15 so far)" in d.reason


def test_an_optimizer_async_cannot_shard_keeps_the_job_out_of_async() -> None:
    """The ranks say their optimizer keeps non-elementwise state (sgdjob_async_capable 0): the job
    where async would win otherwise takes the best change without it."""
    d = _first_change(_straggler_job(0.999, async_capable=False))
    assert not (isinstance(d, SwitchMode) and d.mode == "async"), d.reason


def test_where_the_gradient_turns_fast_the_same_job_rebalances_sync() -> None:
    d = _first_change(_straggler_job(0.3))
    assert isinstance(d, Rebalance), d.reason
    assert "correlation 0.300" in d.reason


def test_without_gradient_statistics_the_decision_says_it_assumed_the_prior() -> None:
    d = _first_change(_straggler_job(None))
    assert "assumed (stalenessPenalty 0.02" in d.reason


def test_async_pushes_sharing_an_adaptive_optimizer_are_damped_by_their_noisiest() -> None:
    """The parameter server's Adam divides every push by the pushes' common RMS: a worker left a batch
    of 1 that pushes often damps the large batches' pushes too, where their own figure says ~1."""
    adam = Efficiency(0.02, noise_scale=4.0, correlation=0.9, adaptive=True, reference_batch=96)
    assert adam.shared_worth([(72, 8.0)]) == pytest.approx(adam.batch_worth(72))
    assert adam.batch_worth(72) > 0.97
    mixed = adam.shared_worth([(72, 8.0), (23, 7.0), (1, 35.0)])
    spread = (8 * (1 + 4 / 72) + 7 * (1 + 4 / 23) + 35 * (1 + 4)) / 50
    assert mixed == pytest.approx(math.sqrt((1 + 4 / 96) / spread)) and mixed < 0.6
    lost = Efficiency(0.02, noise_scale=math.inf, adaptive=True, reference_batch=96)
    assert lost.shared_worth([(48, 1.0), (48, 1.0)]) == pytest.approx(math.sqrt(0.5))
    assert lost.shared_worth([(96, 1.0), (1, 1.0)]) == pytest.approx(math.sqrt(2 / 97))
    assert adam.shared_worth([(192, 1.0)]) == 1.0, "never a promised gain"
    sgd = Efficiency(0.02, noise_scale=4.0, correlation=0.9, reference_batch=96)
    assert sgd.shared_worth([(72, 8.0), (1, 35.0)]) == 1.0, "SGD's steps are not divided by an RMS"
