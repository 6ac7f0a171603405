"""A PyTorch Lightning script on SGDJob's adaptation API (docs/adaptation-api.md, "PyTorch
Lightning"): a tiny character-level model (an embedding of the last 16 characters, one hidden layer,
built from code: nothing is downloaded) learns the next character of the source code of a few
standard-library modules.

What makes it an SGDJob script is two lines: the import of SGDJobTrainer and `SGDJobTrainer(...)` in
place of `lightning.Trainer(...)`. Run it as an SGDJob (`sgdjob run examples/lightning/job.yaml`,
training.adaptation: api) and the policy may rebalance its per-rank batch, and an agreed stop
checkpoints and resumes it; run it with plain `torchrun --nproc-per-node=2 train.py` and it trains as
any Lightning script, serving telemetry only and resuming from lightning-out/sgdjob-checkpoints.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from sgdjob_trainer.integrations.lightning import SGDJobTrainer

MODULES = ("json.decoder", "json.encoder", "textwrap", "shlex", "fnmatch", "glob", "bisect", "heapq")


def source_text() -> str:
    """The source of a few pure-Python standard-library modules, printable ASCII only."""
    text = "\n".join(inspect.getsource(__import__(name, fromlist=["_"])) for name in MODULES)
    return "".join(c for c in text if c == "\n" or " " <= c <= "~")


class NextCharacter(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(the `context` characters before a position, the character at it), every `stride` characters."""

    def __init__(self, text: str, context: int, samples: int, stride: int = 7) -> None:
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.context, self.stride = context, stride
        self.samples = min(samples, (len(self.ids) - context - 1) // stride)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = i * self.stride + self.context
        return self.ids[at - self.context : at], self.ids[at]


class CharModel(L.LightningModule):
    """Embedding of the context, one hidden layer, logits over the vocabulary; prints each rank's loss
    and batch size every `every` steps; `seconds` of sleep a step stand in for a bigger model's compute."""

    def __init__(self, vocab: int, context: int, lr: float, every: int, seconds: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(vocab, 16), nn.Flatten(), nn.Linear(16 * context, 128), nn.ReLU(), nn.Linear(128, vocab)
        )
        self.lr, self.every, self.seconds = lr, every, seconds

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        time.sleep(self.seconds)
        step = self.global_step + 1  # the optimizer step this batch makes
        if step % self.every == 0:
            print(f"rank {self.global_rank} step {step}: loss {loss.item():.4f} (batch {len(y)})", flush=True)
        self.log("loss", loss)
        return loss

    def on_train_start(self) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        where = f"rank {self.global_rank}/{self.trainer.world_size} restart {restart}"
        print(f"{where}: starting at step {self.global_step}", flush=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# The script's options and their defaults; --batch-size is per rank: the job's spec.training.batchSize.
OPTIONS: dict[str, Any] = {
    "max_steps": 200, "batch_size": 16, "lr": 3e-3, "context": 16, "samples": 1024,
    "output_dir": "lightning-out", "log_every": 10, "step_seconds": 0.0,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args()

    torch.manual_seed(0)
    data = NextCharacter(source_text(), args.context, args.samples)
    model = CharModel(len(data.vocab), args.context, args.lr, args.log_every, args.step_seconds)
    trainer = SGDJobTrainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        max_steps=args.max_steps,
        default_root_dir=args.output_dir,
        enable_checkpointing=False,  # the session checkpoints (training.checkpoint.intervalSteps, at a stop)
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if trainer.global_rank == 0:
        print(f"done: {trainer.global_step} steps, last loss {float(trainer.callback_metrics['loss']):.4f}", flush=True)


if __name__ == "__main__":
    main()
