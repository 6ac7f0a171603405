"""The goodput benchmark's held-out set (issue #37): what it holds (worker counts, factors, the late
straggler's start, seeds the tuning never used), that the command line selects it and runs each
scenario on its own workers, and the `auto-default` system at the shipping policy interval. No
torchrun run: the runners are replaced by recorders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import bench.goodput as goodput
from bench.goodput import BUDGET_S, CONFIG, FULL_SEEDS, at_shipping_interval, lb_batches, shipping_interval
from bench.goodput_scoring import SYSTEMS
from bench.scenarios import (
    GOODPUT_SCENARIOS,
    HELDOUT,
    HELDOUT_SCENARIOS,
    HELDOUT_SHAPES,
    LATE_START_FRACTION,
    SCENARIO_SETS,
    TUNING,
    TUNING_SEEDS_USED,
    BenchConfig,
    Scenario,
    build_scenario,
    job_doc,
    rank_factor,
    scenario_config,
    seeds_of,
    slowest_rank,
)
from bench.systems import RunRecord
from sgdjob_operator.api.models import PolicySpec
from sgdjob_operator.api.validation import validate_job

# The tuning set's homogeneous pace on 4 workers (full run of a417476: 2041 samples/s, 128 a step).
TUNING_STEPS_PER_S = 2041 / 128


def _held(name: str) -> tuple[BenchConfig, Scenario]:
    cfg = scenario_config(name, CONFIG)
    return cfg, build_scenario(name, cfg)


def _factors(cfg: BenchConfig, scenario: Scenario, step: int) -> list[float]:
    return [rank_factor(scenario.slowdowns, r, step) for r in range(cfg.workers)]


def test_the_heldout_scenarios_have_their_worker_counts_and_factors() -> None:
    assert SCENARIO_SETS == {TUNING: GOODPUT_SCENARIOS, HELDOUT: HELDOUT_SCENARIOS}
    assert not set(HELDOUT_SCENARIOS) & set(GOODPUT_SCENARIOS)
    assert {n: scenario_config(n, CONFIG).workers for n in HELDOUT_SCENARIOS} == {
        "3w-straggler-2x": 3,
        "6w-straggler-5x": 6,
        "8w-two-classes": 8,
        "4w-late-straggler-3x": 4,
    }
    cfg, s = _held("3w-straggler-2x")
    assert _factors(cfg, s, 0) == _factors(cfg, s, 199) == [1.0, 1.0, 2.0]
    cfg, s = _held("6w-straggler-5x")
    assert _factors(cfg, s, 0) == _factors(cfg, s, 199) == [1.0] * 5 + [5.0]
    assert cfg.compute_seconds == pytest.approx(0.03)  # DDP waits 0.15 s a step, the tuning's pace
    cfg, s = _held("8w-two-classes")
    assert _factors(cfg, s, 0) == _factors(cfg, s, 199) == [1.0] * 4 + [1.5] * 4
    assert s.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    # The tuning set keeps the task's config untouched.
    assert all(scenario_config(n, CONFIG) is CONFIG for n in GOODPUT_SCENARIOS)
    # The 1.5x, 2x and 5x, and the tuning's 3x for the straggler that appears late.
    factors = {float(d["factor"]) for n in HELDOUT_SCENARIOS for d in _held(n)[1].slowdowns}
    assert factors == {1.5, 2.0, 5.0, 3.0}


def test_the_late_straggler_appears_after_a_third_of_the_budget_and_stays() -> None:
    cfg, s = _held("4w-late-straggler-3x")
    (spell,) = s.slowdowns
    start = int(spell["startStep"])
    assert start == round(CONFIG.steps * LATE_START_FRACTION) == 40 and "endStep" not in spell
    assert _factors(cfg, s, start - 1) == [1.0] * 4
    assert _factors(cfg, s, start) == _factors(cfg, s, cfg.steps - 1) == [1.0, 1.0, 1.0, 3.0]
    # At the tuning set's pace the spell starts about a third into the 8-s budget.
    assert 0.25 <= start / TUNING_STEPS_PER_S / BUDGET_S <= 0.4
    assert slowest_rank(cfg, s) == 3  # ddp-drop drops it


def test_heldout_seeds_are_ones_the_tuning_never_used() -> None:
    assert seeds_of(HELDOUT, FULL_SEEDS) == [100, 101, 102]
    assert seeds_of(TUNING, FULL_SEEDS) == [0, 1, 2]  # the tuning set's seeds, as before
    assert set(seeds_of(TUNING, FULL_SEEDS)) <= set(TUNING_SEEDS_USED)
    assert not set(seeds_of(HELDOUT, 50)) & set(TUNING_SEEDS_USED)


def test_every_heldout_job_is_valid_and_lb_bsp_splits_its_global_batch() -> None:
    for name in HELDOUT_SCENARIOS:
        cfg, s = _held(name)
        for mode in ("auto", "sync", "hierarchical", "async"):
            spec = validate_job(job_doc(cfg, s, mode)).spec
            assert spec.nproc_per_node == cfg.workers and spec.training.emulation is not None
        batches = lb_batches(cfg, s)
        assert sum(batches.values()) == cfg.workers * cfg.batch_size
        slow = {d["rank"] for d in s.slowdowns}
        assert max(batches[r] for r in slow) < min(batches[r] for r in range(cfg.workers) if r not in slow)


def test_auto_default_is_auto_at_the_shipping_policy_interval(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert "auto-default" in SYSTEMS and "auto" in SYSTEMS
    assert shipping_interval() == PolicySpec().interval_seconds == 10.0
    shipped = at_shipping_interval(CONFIG)
    assert CONFIG.policy["intervalSeconds"] == 0.5  # the tuning's interval, auto's
    assert shipped.policy == {**CONFIG.policy, "intervalSeconds": 10.0}  # only the interval differs
    calls: list[tuple[str, float, str | None]] = []

    def record(cfg: BenchConfig, scenario: Scenario, mode: str, out_dir: Path, timeout_s: float, **kw: Any) -> Any:
        calls.append((mode, cfg.policy["intervalSeconds"], kw.get("system")))
        return RunRecord(kw.get("system") or mode, out_dir, 0.0)

    monkeypatch.setattr(goodput, "run_sgdjob", record)
    one = build_scenario("one-straggler", CONFIG)
    for system in ("auto", "auto-default"):
        goodput.run_system(CONFIG, one, system, tmp_path / system, 60.0)
    assert calls == [("auto", 0.5, None), ("auto", 10.0, "auto-default")]


class _Stop(Exception):
    """Raised by the recording run_benchmark: the command line was parsed, nothing is run."""


def _parsed(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake(cfg: BenchConfig, scenarios: list[str], systems: list[str], seeds: list[int], out: Path, **kw: Any) -> Any:
        seen.update(cfg=cfg, scenarios=scenarios, systems=systems, seeds=seeds, **kw)
        raise _Stop

    monkeypatch.setattr(goodput, "run_benchmark", fake)
    with pytest.raises(_Stop):
        goodput.main(argv)
    return seen


def test_the_command_line_selects_the_heldout_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = ["--out", str(tmp_path)]
    default = _parsed(monkeypatch, out)
    assert default["scenario_set"] == TUNING and default["scenarios"] == list(GOODPUT_SCENARIOS)
    assert default["seeds"] == [0, 1, 2] and default["overrides"] is None and default["systems"] == list(SYSTEMS)
    held = _parsed(monkeypatch, ["--set", "heldout", *out])
    assert held["scenario_set"] == HELDOUT and held["scenarios"] == list(HELDOUT_SCENARIOS)
    assert held["seeds"] == [100, 101, 102]
    one = _parsed(monkeypatch, ["--set", "heldout", "--seeds", "1", "--steps", "40", *out])
    assert one["seeds"] == [100] and one["overrides"] == {"steps": 40}
    quick = _parsed(monkeypatch, ["--set", "heldout", "--quick", *out])
    assert quick["seeds"] == [100] and set(quick["scenarios"]) <= set(HELDOUT_SCENARIOS)
    for bad in (["--set", "heldout", "--scenarios", "one-straggler"], ["--set", "heldout", "--workers", "4"]):
        with pytest.raises(SystemExit):
            goodput.main([*bad, *out])
    with pytest.raises(SystemExit):
        goodput.main(["--scenarios", "8w-two-classes", *out])  # a held-out scenario needs --set heldout


def test_a_heldout_scenario_runs_on_its_own_workers_and_seeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs: list[tuple[str, int, float, int, int]] = []

    def record(cfg: BenchConfig, scenario: Scenario, system: str, run_dir: Path, timeout_s: float) -> RunRecord:
        runs.append((system, cfg.workers, cfg.compute_seconds, cfg.steps, cfg.seed))
        return RunRecord(system, run_dir, 0.0, error="not run (test)")

    monkeypatch.setattr(goodput, "run_system", record)
    doc = goodput.run_benchmark(
        CONFIG,
        ["6w-straggler-5x"],
        ["ddp", "auto-default"],
        seeds_of(HELDOUT, 1),
        tmp_path,
        target=0.9,
        budget_s=8.0,
        timeout_s=60.0,
        scenario_set=HELDOUT,
        overrides={"steps": 40},
    )
    assert runs == [("ddp", 6, 0.03, 40, 100), ("auto-default", 6, 0.03, 40, 100)]
    (result,) = doc["results"]
    assert (result["set"], result["workers"], result["steps"]) == (HELDOUT, 6, 40)
    assert result["emulation"]["computeSeconds"] == 0.03 and len(result["rank_speeds"]) == 6
    assert doc["metadata"]["set"] == HELDOUT and doc["metadata"]["auto_default_interval_s"] == 10.0
    assert set(HELDOUT_SHAPES) == set(HELDOUT_SCENARIOS)
