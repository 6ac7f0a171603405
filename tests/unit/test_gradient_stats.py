"""The trainer's gradient statistics recover what a known gradient distribution has."""

from __future__ import annotations

import math

import torch

from sgdjob_trainer.gradient_stats import GradientFigures, GradientStats

DIM = 400


def _step(stats: GradientStats, true: torch.Tensor, sigma: float, batch: int, world: int, gen: torch.Generator) -> None:
    """One synchronous step of `world` ranks with `batch` samples each: per-sample gradients are
    `true` plus isotropic noise of standard deviation `sigma` per coordinate (tr(S) = DIM sigma^2)."""
    locals_ = [true + torch.randn(DIM, generator=gen) * sigma / math.sqrt(batch) for _ in range(world)]
    average = torch.stack(locals_).mean(0)
    stats.observe(locals_[0], batch, average, batch * world)


def test_noise_scale_and_gradient_norm_match_the_distribution_they_come_from() -> None:
    gen = torch.Generator().manual_seed(0)
    true = torch.full((DIM,), 0.05)  # |G|^2 = 1.0
    sigma = 0.5  # tr(S) = 100, so the noise scale is 100 samples
    stats = GradientStats()
    for _ in range(400):
        _step(stats, true, sigma, batch=16, world=4, gen=gen)
    figures = stats.figures()
    assert figures.steps == 400
    assert figures.sq_norm is not None and figures.variance is not None and figures.lag_dot is not None
    assert abs(figures.sq_norm - 1.0) < 0.25
    assert abs(figures.variance - 100.0) < 15.0
    assert abs(figures.variance / figures.sq_norm - 100.0) < 30.0
    # A gradient that does not turn: consecutive true gradients are the same vector.
    assert abs(figures.lag_dot / figures.sq_norm - 1.0) < 0.3


def test_a_gradient_that_turns_every_step_reads_as_low_correlation() -> None:
    gen = torch.Generator().manual_seed(1)
    stats = GradientStats()
    angle = math.pi / 3  # cos = 0.5 between consecutive true gradients
    for t in range(400):
        true = torch.zeros(DIM)
        true[0], true[1] = math.cos(angle * t), math.sin(angle * t)
        _step(stats, true, sigma=0.2, batch=32, world=4, gen=gen)
    figures = stats.figures()
    assert figures.sq_norm is not None and figures.lag_dot is not None
    assert abs(figures.lag_dot / figures.sq_norm - 0.5) < 0.15


def test_a_switch_breaks_the_lag_and_a_single_rank_measures_nothing() -> None:
    stats = GradientStats()
    g = torch.ones(DIM)
    stats.observe(g, 8, g, 8)
    assert stats.figures().steps == 0, "a step whose local batch is the whole batch says nothing about noise"
    stats.observe(g, 8, g, 16)
    stats.interrupt()
    stats.observe(g, 8, g, 16)
    assert stats.figures().steps == 2 and stats.figures().lag_dot is None, "no pair of consecutive steps yet"
    stats.observe(g, 8, g * float("nan"), 16)
    assert stats.figures().steps == 2, "a non-finite average is skipped"


def _async_run(rho: float, sigma: float, batch: int, steps: int, seed: int) -> GradientStats:
    """One async worker's gradients: a true gradient of norm 1 that keeps `rho` of itself from one of
    the worker's steps to the next (the rest a fresh direction), plus per-sample noise of `sigma`."""
    gen = torch.Generator().manual_seed(seed)
    stats = GradientStats()
    stats.enter("async")
    true = torch.randn(DIM, generator=gen)
    true /= true.norm()
    for _ in range(steps):
        fresh = torch.randn(DIM, generator=gen)
        fresh -= torch.dot(fresh, true) * true
        true = rho * true + math.sqrt(1 - rho**2) * fresh / fresh.norm()
        stats.observe_own(true + torch.randn(DIM, generator=gen) * sigma / math.sqrt(batch), batch)
    return stats


def test_async_steps_measure_the_correlation_and_noise_from_one_workers_consecutive_gradients() -> None:
    """The controller's worth of a stale gradient stays current while the job runs async: a gradient
    that keeps turning reads as one, where the synchronous figures before it would not."""
    for rho in (0.95, 0.5):
        errors = []
        for seed in range(4):
            f = _async_run(rho, sigma=0.5, batch=32, steps=300, seed=seed).figures()
            assert f.sq_norm is not None and f.variance is not None and f.lag_dot is not None
            errors.append(f.lag_dot / f.sq_norm - rho)
        assert abs(sum(errors) / len(errors)) < 0.12, (rho, errors)
    steady = _async_run(0.95, sigma=0.5, batch=32, steps=300, seed=9).figures()
    assert steady.steps == 298 and steady.sq_norm is not None and steady.variance is not None
    assert abs(steady.sq_norm - 1.0) < 0.3 and abs(steady.variance - DIM * 0.25) < 40  # tr(S) = DIM sigma^2
    # Consecutive gradients that point apart (an oscillation): no figure, so no verdict from the lags.
    for seed in range(4):
        apart = _async_run(-0.6, sigma=0.3, batch=32, steps=300, seed=seed).figures()
        assert apart.sq_norm is None and apart.lag_dot is None, apart


def test_async_lags_buried_in_the_samples_noise_read_as_unknown_never_as_worthless() -> None:
    """Where the noise scale is hundreds of times a rank's batch (measured on real nodes: 428 samples at
    16 a rank), one worker's lag products are noise of either sign; a correlation read off them would
    make the controller leave async at once (`worthless`) on a gradient that barely turns."""
    for seed in range(8):
        # rho 0.9 with tr(S)/b = 225 |G|^2: the e2e job's regime; 45 steps, as long as its stay lasted.
        figures = _async_run(0.9, sigma=3.0, batch=16, steps=47, seed=seed).figures()
        assert figures.steps == 45 and figures == GradientFigures(45, None, None, None), (seed, figures)
    # A gradient that decorrelates at once has lags of zero: nothing in them tells it from noise either.
    lost = _async_run(0.0, sigma=0.5, batch=32, steps=300, seed=3).figures()
    assert lost.sq_norm is None and lost.lag_dot is None, lost


def test_each_stay_in_a_mode_measures_afresh_from_the_steps_it_has() -> None:
    stats = _async_run(0.9, sigma=0.1, batch=16, steps=50, seed=0)
    assert stats.figures().steps == 48
    stats.enter("async")
    assert stats.figures().steps == 48, "a restart in the same mode keeps its figures"
    g = torch.ones(DIM)
    stats.enter("sync")
    assert stats.figures() == GradientFigures(0, None, None, None), "back in sync: nothing measured yet"
    stats.observe(g, 8, g, 16)
    assert stats.figures().steps == 1 and stats.figures().lag_dot is None, "the sync figures"
    stats.enter("async")
    assert stats.figures() == GradientFigures(0, None, None, None), "async: nothing measured yet"
    stats.observe_own(g, 16)
    stats.observe_own(g, 16)
    assert stats.figures().steps == 0 and stats.figures().sq_norm is None, "a new stay: nothing measured yet"
    stats.interrupt()
    stats.observe_own(g, 16)
    stats.observe_own(g * float("nan"), 16)
    stats.observe_own(g, 16)
    assert stats.figures().steps == 0, "a switch or a non-finite gradient breaks the chain of consecutive steps"


def test_hierarchical_measures_its_groups_and_a_rank_alone_measures_its_own_gradients() -> None:
    """A hierarchical group's steps are synchronous pairs, never paired across a cross-group average
    (`interrupt`); a rank alone in its group reads its own consecutive gradients, as async does."""
    gen = torch.Generator().manual_seed(4)
    grouped, alone = GradientStats(), GradientStats()
    grouped.enter("sync")
    true = torch.full((DIM,), 0.05)
    for _ in range(30):
        _step(grouped, true, 0.5, batch=16, world=4, gen=gen)
    turned = torch.zeros(DIM)
    turned[0] = 1.0  # a direction unrelated to the sync steps' gradient: |G|^2 = 1
    for stats in (grouped, alone):
        stats.enter("hierarchical")
        assert stats.figures().steps == 0, "the sync steps' figures are not the hierarchical ones"
    for t in range(200):
        _step(grouped, turned, 0.5, batch=16, world=2, gen=gen)
        alone.observe_own(turned + torch.randn(DIM, generator=gen) * 0.5 / 4, 16)
        if t % 4 == 3:  # a cross-group model average every 4 steps
            grouped.interrupt()
            alone.interrupt()
    for stats in (grouped, alone):
        f = stats.figures()
        assert f.sq_norm is not None and f.lag_dot is not None, stats
        assert abs(f.sq_norm - 1.0) < 0.3 and abs(f.lag_dot / f.sq_norm - 1.0) < 0.3, f
    assert grouped.figures().steps == 200 and alone.figures().steps == 100  # 2 of each 4 steps have two before them
