"""A PyTorch Lightning script on SGDJob's adaptation API (docs/adaptation-api.md, "PyTorch
Lightning"): a tiny character-level model (an embedding of the last 16 characters, one hidden layer,
built from code: nothing is downloaded) learns the next character of the source code of a few
standard-library modules.

What makes it an SGDJob script is two lines: the import of SGDJobTrainer and `SGDJobTrainer(...)` in
place of `lightning.Trainer(...)`. Run it as an SGDJob (`sgdjob run examples/lightning/job.yaml`,
training.adaptation: api) and the policy may rebalance its per-rank batch, and an agreed stop
checkpoints and resumes it; run it with plain `torchrun --nproc-per-node=2 train.py` and it trains as
any Lightning script, serving telemetry only and resuming from lightning-out/sgdjob-checkpoints.

Two opt-in extras serve bench/goodput_frameworks.py (off by default): an EMULATED straggler
(`--sample-seconds S --slow-rank R --slow-factor K`: every rank sleeps S seconds per sample of the
batch it trains on, rank R K times that, so a smaller batch really makes it faster) and a validation
(`--validate-every N`: rank 0 writes the loss on held-out positions no rank trains on to
--output-dir/validation.jsonl every N steps, with the seconds since training began).
"""

from __future__ import annotations

import argparse
import inspect
import json
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

    def __init__(self, text: str, context: int, samples: int, stride: int = 7, skip: int = 0) -> None:
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.context, self.stride, self.skip = context, stride, skip
        self.samples = max(0, min(samples, (len(self.ids) - context - 1) // stride - skip))

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = (self.skip + i) * self.stride + self.context
        return self.ids[at - self.context : at], self.ids[at]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sample, stacked: (contexts, next characters)."""
        xs, ys = zip(*(self[i] for i in range(len(self))), strict=True)
        return torch.stack(xs), torch.stack(ys)


class CharModel(L.LightningModule):
    """Embedding of the context, one hidden layer, logits over the vocabulary; prints each rank's loss
    and batch size every `every` steps; `seconds` of sleep a step, and `per_sample` a sample of the
    batch, stand in for a bigger model's compute (the latter scales with the batch, as compute does,
    so a rebalance can speed a rank up)."""

    def __init__(
        self, vocab: int, context: int, lr: float, every: int, seconds: float, per_sample: float = 0.0
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(vocab, 16), nn.Flatten(), nn.Linear(16 * context, 128), nn.ReLU(), nn.Linear(128, vocab)
        )
        self.lr, self.every, self.seconds, self.per_sample = lr, every, seconds, per_sample
        # Rank 0's validation (`validate`): held-out samples, every `validate_every` steps, to `validation_path`.
        self.heldout: tuple[torch.Tensor, torch.Tensor] | None = None
        self.validate_every, self.validation_path, self.start = 0, "", time.monotonic()

    def validate(self, heldout: NextCharacter, every: int, path: str) -> None:
        self.heldout, self.validate_every, self.validation_path = heldout.tensors(), every, path

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        time.sleep(self.seconds + self.per_sample * len(y))
        step = self.global_step + 1  # the optimizer step this batch makes
        if step % self.every == 0:
            print(f"rank {self.global_rank} step {step}: loss {loss.item():.4f} (batch {len(y)})", flush=True)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.heldout is None or self.global_step % self.validate_every:
            return
        x, y = (t.to(self.device) for t in self.heldout)
        self.net.eval()
        with torch.no_grad():  # the bare network, not DDP's wrapper: no collective on rank 0 alone
            loss = float(nn.functional.cross_entropy(self.net(x), y))
        self.net.train()
        row = {"time_s": round(time.monotonic() - self.start, 4), "step": self.global_step, "loss": loss}
        with open(self.validation_path, "a") as out:
            out.write(json.dumps(row) + "\n")

    def on_train_start(self) -> None:
        self.start = time.monotonic()
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
    # The seed of the model's initialisation and the data's order; an EMULATED straggler: seconds of
    # sleep a sample trained on, every rank, --slow-factor x that on --slow-rank (-1: none); rank 0's
    # validation every --validate-every steps (0: none) on --val-samples held-out positions.
    "seed": 0, "sample_seconds": 0.0, "slow_rank": -1, "slow_factor": 3.0, "validate_every": 0, "val_samples": 512,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)  # also the seed of the DistributedSampler Lightning makes
    text = source_text()
    data = NextCharacter(text, args.context, args.samples)
    slow = int(os.environ.get("RANK", "0")) == args.slow_rank
    per_sample = args.sample_seconds * (args.slow_factor if slow else 1.0)
    model = CharModel(len(data.vocab), args.context, args.lr, args.log_every, args.step_seconds, per_sample)
    if args.validate_every > 0 and int(os.environ.get("RANK", "0")) == 0:
        heldout = NextCharacter(text, args.context, args.val_samples, skip=len(data))
        if len(heldout) == 0:
            parser.error(f"no held-out positions are left after --samples {args.samples}")
        os.makedirs(args.output_dir, exist_ok=True)
        model.validate(heldout, args.validate_every, os.path.join(args.output_dir, "validation.jsonl"))
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
