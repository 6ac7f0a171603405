"""The goodput claim under test (#37.7): on a persistent straggler, auto trains the model to the
target sooner than DDP, without losing accuracy. Tiny (digits MLP, 3 workers, one seed, one rank 3x
slower by the emulator's sleep) and with a wide margin: measured 0.52x DDP here, the claim fails at
0.75x, so a policy that stops rebalancing (1.0x) or rebalances late fails CI, and machine noise does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc


def test_auto_reaches_the_target_sooner_than_ddp_on_a_persistent_straggler(tmp_path: Path) -> None:
    from bench.goodput import main

    out = tmp_path / "claim"
    argv = "--task digits-mlp --workers 3 --scenarios one-straggler --systems ddp,auto --seeds 1"
    code = main([*argv.split(), "--compute-seconds", "0.04", "--target", "0.85", "--budget", "6", "--out", str(out)])
    systems = json.loads((out / "goodput.json").read_text())["results"][0]["systems"]
    ddp, auto = systems["ddp"], systems["auto"]
    assert ddp["ok"] and auto["ok"], (ddp["runs"][0].get("error"), auto["runs"][0].get("error"))
    ddp_s, auto_s = ddp["time_to_target_s"]["median"], auto["time_to_target_s"]["median"]
    assert ddp_s is not None and auto_s is not None, "both reach the target within the run's steps"
    ratio = auto_s / ddp_s
    accuracy = auto["accuracy_at_budget"]["median"] - ddp["accuracy_at_budget"]["median"]
    print(f"one 3x straggler of 3: auto {auto_s:.1f} s / DDP {ddp_s:.1f} s = {ratio:.2f}x, accuracy {accuracy:+.3f}")
    assert ratio <= 0.75, f"auto {auto_s:.1f} s vs DDP {ddp_s:.1f} s to the target"
    assert accuracy >= -0.05, "auto reached the target sooner by learning less per sample"
    assert any("rebalance" in m or "async" in m or "hierarchical" in m for m in auto["runs"][0]["modes"])
    assert code == 0
