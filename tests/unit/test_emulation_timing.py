"""The emulated step time (sgdjob_trainer.emulation): fixed + per-sample part, the factor on the whole
step, spells by step or by time, bursts that come in runs; and that a config of before reads the same."""

from __future__ import annotations

import random

import pytest

from sgdjob_operator.api.validation import SpecError, validate_job
from sgdjob_trainer.config import Bursts, Emulation, SpeedChange
from sgdjob_trainer.emulation import ComputeEmulator, in_burst, in_spell, spell_factor, step_seconds
from tests.unit.test_cpu_limits import job_doc


def test_a_step_is_a_fixed_part_plus_a_per_sample_part_all_slowed_by_the_factor() -> None:
    assert step_seconds(0.0, 0.1, 16, 32, 3.0) == pytest.approx(0.15)  # today's rule: all per-sample
    assert step_seconds(0.02, 0.1, 16, 32, 3.0) == pytest.approx((0.02 + 0.05) * 3.0)
    # Halving the batch does not halve the step when part of it is fixed (rebalancing gains less).
    assert step_seconds(0.05, 0.05, 16, 32, 1.0) / step_seconds(0.05, 0.05, 32, 32, 1.0) == pytest.approx(0.75)


def test_existing_configs_give_the_same_times_as_before() -> None:
    emu = Emulation(compute_seconds=0.1, jitter=0.2, slowdowns=[SpeedChange(rank=1, factor=3.0, start_step=5)])
    new = ComputeEmulator(emu, rank=1, node="n", reference_batch=32, seed=4)
    old_rng = random.Random(4 * 65_537 + 1)
    for step in range(10):
        noise = 1.0 + old_rng.uniform(-0.2, 0.2)
        before = 0.1 * (3.0 if step >= 5 else 1.0) * (24 / 32) * noise  # the rule before fixedSeconds and bursts
        assert new.seconds(step, 24, elapsed_s=0.0) == pytest.approx(before)


def test_spells_in_seconds_and_in_steps() -> None:
    by_time = SpeedChange(rank=0, factor=2.0, start_seconds=10.0, end_seconds=20.0)
    assert [in_spell(by_time, 0, t) for t in (9.9, 10.0, 19.9, 20.0)] == [False, True, True, False]
    open_ended = SpeedChange(node="a", factor=4.0, start_seconds=5.0)
    by_step = SpeedChange(rank=0, factor=3.0, start_step=2, end_step=4)
    changes = [by_time, open_ended, by_step]
    assert spell_factor(changes, 0, "a", step=3, elapsed_s=12.0) == pytest.approx(2.0 * 4.0 * 3.0)
    assert spell_factor(changes, 0, "b", step=5, elapsed_s=1.0) == 1.0
    assert spell_factor(changes, 1, "a", step=3, elapsed_s=6.0) == 4.0


def test_bursts_come_in_runs_and_replay_from_the_seed() -> None:
    bursts = Bursts(probability=0.3, steps=8, factor=2.5)
    flags = [in_burst(bursts, 7, 0, s) for s in range(8000)]
    blocks = [flags[i : i + 8] for i in range(0, 8000, 8)]
    assert all(len(set(b)) == 1 for b in blocks), "a burst covers its whole block"
    assert 0.25 < sum(b[0] for b in blocks) / len(blocks) < 0.35
    assert flags == [in_burst(bursts, 7, 0, s) for s in range(8000)], "the same on a rerun or a resume"
    assert flags != [in_burst(bursts, 7, 1, s) for s in range(8000)], "each rank has its own"
    emu = ComputeEmulator(Emulation(compute_seconds=0.1, bursts=bursts), 0, "n", 32, 7)
    assert {round(emu.seconds(s, 32, 0.0), 9) for s in range(64)} == {0.1, 0.25}


def test_fixed_seconds_alone_still_sleeps_and_none_sleeps_nothing() -> None:
    assert ComputeEmulator(Emulation(compute_seconds=0.0, fixed_seconds=0.01), 0, "n", 32, 0).seconds(0, 32) == 0.01
    assert ComputeEmulator(Emulation(compute_seconds=0.0), 0, "n", 32, 0).seconds(0, 32) == 0.0
    assert ComputeEmulator(None, 0, "n", 32, 0).seconds(0, 32) == 0.0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rank": 0, "startStep": 3, "startSeconds": 1.0}, "startSeconds"),
        ({"rank": 0, "startSeconds": 5.0, "endSeconds": 5.0}, "endSeconds"),
    ],
)
def test_a_spell_in_both_steps_and_seconds_or_backwards_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_job(job_doc(replicas=1, slowdowns=[change]))
    assert err.value.problems[0].startswith(f"spec.training.emulation.slowdowns[0].{field}:")
