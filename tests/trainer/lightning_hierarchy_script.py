"""Run by tests/trainer/test_lightning_hierarchy.py under torchrun (4 gloo ranks): hierarchy_script.py's
run, written as a Lightning module under SGDJobTrainer. The ranks claim two nodes of two ranks each
(NODE_NAME), and an opt-in slow rank sleeps in its training_step (an EMULATED straggler). At the start of
every batch each rank writes one JSON line to OUT/rank<R>.jsonl: the session's step so far, the mode it
is in, the wall clock, its parameters and momentum. Training stops `--after-sync` steps after the
session came back to sync from hierarchical (every rank sees the switch at the same step)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hierarchy_script import StepLog, arguments, regression_data, write_final  # beside this file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sgdjob_trainer.integrations.lightning import SGDJobCallback, SGDJobTrainer


class Regression(L.LightningModule):
    def __init__(self, pause: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.pause = pause

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        time.sleep(self.pause)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)  # momentum: state to average


class Record(L.Callback):
    def __init__(self, out: Path, rank: int, after_sync: int) -> None:
        self.steps = StepLog(out, rank, after_sync)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        session = SGDJobCallback.session_of(trainer)
        if session.step_count == 0:
            return
        params = list(pl_module.parameters())
        if self.steps.record(session.step_count, session.telemetry.mode.value, params, trainer.optimizers[0]):
            trainer.should_stop = True  # every rank at the same step: the switch back is agreed


def main() -> None:
    args = arguments()
    rank = int(os.environ["RANK"])
    x, y = regression_data()
    model = Regression(args.slow_seconds if rank == args.slow_rank else args.step_seconds)
    trainer = SGDJobTrainer(
        accelerator="cpu", max_steps=args.max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Record(args.out, rank, args.after_sync)],
    )  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    write_final(args.out, rank, model)


if __name__ == "__main__":
    main()
