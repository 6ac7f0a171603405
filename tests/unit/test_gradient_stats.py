"""The trainer's gradient statistics recover what a known gradient distribution has."""

from __future__ import annotations

import math

import torch

from sgdjob_trainer.gradient_stats import GradientStats

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
