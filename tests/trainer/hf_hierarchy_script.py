"""Run by tests/trainer/test_adapt_hierarchy.py under torchrun (4 gloo ranks): hierarchy_script.py's run,
written as a Hugging Face Trainer under SGDJobTrainer. The ranks claim two nodes of two ranks each
(NODE_NAME), and an opt-in slow rank sleeps in its forward pass (an EMULATED straggler). The model takes
loss kwargs and divides its summed loss by Trainer's item count, with `average_tokens_across_devices` on
(Trainer's default, as for GPT-2): the count Trainer gathers over the world before every step is what
hierarchical must not wait for. At the start of every step each rank writes one JSON line to
OUT/rank<R>.jsonl: the session's step so far, the mode it is in, the wall clock, its parameters and
momentum. Training stops `--after-sync` steps after the session came back to sync from hierarchical."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hierarchy_script import StepLog, arguments, regression_data, write_final  # beside this file
from torch import nn
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments

from sgdjob_trainer.integrations.hf import SGDJobTrainer


class Regression(nn.Module):
    def __init__(self, pause: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.pause = pause

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **loss_kwargs: Any) -> dict[str, torch.Tensor]:
        error = (self.net(x) - labels).square().sum()
        items = loss_kwargs.get("num_items_in_batch")
        time.sleep(self.pause)
        return {"loss": error / items if items is not None else error / labels.numel()}


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Record(TrainerCallback):  # type: ignore[misc]
    def __init__(self, out: Path, rank: int, after_sync: int) -> None:
        self.steps = StepLog(out, rank, after_sync)
        self.trainer: SGDJobTrainer | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        session = self.trainer.sgdjob
        if session.step_count == 0:
            return
        params = list(self.trainer.model.parameters())
        optimizer = self.trainer.optimizer.optimizer  # accelerate's wrapper holds Trainer's
        if self.steps.record(session.step_count, session.telemetry.mode.value, params, optimizer):
            control.should_training_stop = True  # after this step, on every rank alike


def main() -> None:
    args = arguments()
    rank = int(os.environ["RANK"])
    x, y = regression_data()
    model = Regression(args.slow_seconds if rank == args.slow_rank else args.step_seconds)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)  # momentum: state to average
    record = Record(args.out, rank, args.after_sync)
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=scratch, per_device_train_batch_size=8, max_steps=args.max_steps,
            lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none", disable_tqdm=True, use_cpu=True,
            average_tokens_across_devices=True, ddp_find_unused_parameters=False, save_strategy="no", seed=0,
        )  # fmt: skip
        trainer = SGDJobTrainer(
            model=model, args=training, train_dataset=Pairs(x, y), optimizers=(optimizer, None), callbacks=[record]
        )
        record.trainer = trainer
        trainer.train()
    write_final(args.out, rank, model)


if __name__ == "__main__":
    main()
