"""A trimmed split moves sync's learning rate with its global batch: two real trainer processes (gloo).

The policy's trimmed split (policy.candidates `_trim`) gives the slow rank fewer samples without
handing them to the fast one, so the global batch shrinks; under the job's linear lrScaling the
learning rate follows it, as it does for a resized world, and the update per sample stays the same.
A split that keeps the global batch (rebalanced sync) leaves the rate alone.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.trainer_modes import free_port_base, spawned_rank_env
from sgdjob_trainer.trainer import Trainer
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import RunConfig

pytestmark = pytest.mark.multiproc
WORLD = 2
LR = 0.05
# (step after which rank 0's controller sends it, batch sizes): a rebalance keeping 32, then a trim to 24.
COMMANDS = [(4, {0: 20, 1: 12}), (9, {0: 16, 1: 8})]
STEPS = 14


def _child(rank: int, port: int, out: str) -> None:
    spawned_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    training = {"steps": STEPS, "batchSize": 16, "learningRate": LR, "seed": 3, "lrScaling": "linear"}
    trainer = Trainer(RunConfig.model_validate({"mode": "sync", "referenceWorldSize": WORLD, "training": training}))
    seen: list[dict[str, Any]] = []
    optimizer = trainer.state.optimizer
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        seen.append({"step": trainer.state.step, "lr": optimizer.param_groups[0]["lr"]})
        return original(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    if trainer.inbox is not None:
        inbox, telemetry = trainer.inbox, trainer.telemetry

        def push() -> None:
            for epoch, (after, sizes) in enumerate(COMMANDS, start=1):
                while telemetry.status().step < after and not telemetry.done:
                    time.sleep(0.002)
                inbox.offer(ControlCommand(epoch=epoch, batch_sizes=sizes, reason="test split"))

        threading.Thread(target=push, daemon=True).start()
    trainer.train()
    trainer.server.stop()
    Path(out, f"{rank}.json").write_text(json.dumps({"seen": seen, "batches": trainer.state.batch_sizes}))
    dist.destroy_process_group()


def test_the_learning_rate_follows_a_trimmed_global_batch_and_not_a_rebalanced_one(tmp_path: Path) -> None:
    mp.spawn(_child, args=(free_port_base(1), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        doc = json.loads((tmp_path / f"{rank}.json").read_text())
        assert {int(k): v for k, v in doc["batches"].items()} == COMMANDS[-1][1]
        rates = [s["lr"] for s in doc["seen"]]
        assert len(rates) == STEPS
        # Plain, then rebalanced (32 samples either way): the job's rate; trimmed to 24 of 32: 3/4 of it.
        assert rates[0] == pytest.approx(LR) and rates[-1] == pytest.approx(LR * 24 / 32), rates
        assert set(round(r, 9) for r in rates) == {round(LR, 9), round(LR * 0.75, 9)}, rates
        first_trimmed = next(i for i, r in enumerate(rates) if r != pytest.approx(LR))
        assert first_trimmed > COMMANDS[-1][0], "the rebalance alone did not move the rate"
