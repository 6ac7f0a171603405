"""The DDP baseline exits cleanly: before its teardown was skipped, about one run in three on this
machine aborted at interpreter exit ("terminate called without an active exception") after writing
its results, and torchrun reported the baseline as failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scenarios import BenchConfig, build_scenario
from bench.systems import run_ddp

RUNS = 4


@pytest.mark.multiproc
def test_ddp_baseline_exits_zero_every_time(tmp_path: Path) -> None:
    cfg = BenchConfig(workers=2, steps=24, compute_seconds=0.01)
    scenario = build_scenario("homogeneous", cfg)
    for i in range(RUNS):
        record = run_ddp(cfg, scenario, tmp_path / f"run-{i}", timeout_s=120)
        assert record.error is None, (i, record.error, (record.out_dir / "torchrun.log").read_text()[-2000:])
        assert len(list(record.out_dir.glob("rank-*.json"))) == cfg.workers
