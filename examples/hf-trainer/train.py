"""A Hugging Face Trainer script on SGDJob's adaptation API (docs/adaptation-api.md, "Hugging Face
Trainer"): a tiny GPT-2 (2 layers, 64 wide, built from a config: nothing is downloaded) learns a
character-level language model of the docstrings of a few standard-library modules.

What makes it an SGDJob script is two lines: the import of SGDJobTrainer and `SGDJobTrainer(...)` in
place of `Trainer(...)`. Run it as an SGDJob (`sgdjob run examples/hf-trainer/job.yaml`,
training.adaptation: api) and the policy may rebalance its per-rank batch, and an agreed stop
checkpoints and resumes it; run it with plain `torchrun --nproc-per-node=2 train.py` and it trains as
any Trainer script, serving telemetry only and resuming from --output-dir/sgdjob-checkpoints.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, default_data_collator

from sgdjob_trainer.integrations.hf import SGDJobTrainer

MODULES = ("argparse", "collections", "functools", "json", "pathlib", "subprocess", "textwrap", "typing")


def corpus() -> str:
    """The docstrings of a few standard-library modules and their members, printable ASCII only."""
    parts = []
    for name in MODULES:
        module = __import__(name)
        for _, member in [(name, module), *sorted(vars(module).items())]:
            doc = inspect.getdoc(member) if not isinstance(member, (str, int, float, bytes)) else None
            if doc:
                parts.append(doc)
    text = "\n\n".join(dict.fromkeys(parts))  # each docstring once, in a fixed order
    return "".join(c for c in text if c == "\n" or " " <= c <= "~")


class Characters(Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping windows of `block` characters; the labels are the inputs (GPT-2 shifts them)."""

    def __init__(self, text: str, block: int, samples: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        windows = ids[: len(ids) // block * block].view(-1, block)
        self.windows = windows[:samples]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class Progress(TrainerCallback):  # type: ignore[misc]
    """Every `every` steps, each rank prints its loss and the size of the batch it just trained on;
    `seconds` of sleep a step stand in for a bigger model's compute."""

    def __init__(self, every: int, seconds: float) -> None:
        self.every, self.seconds = every, seconds
        self.batch = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def collate(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        self.batch = len(features)
        return default_data_collator(features)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and state.global_step % self.every == 0:
            print(
                f"rank {self.rank} step {state.global_step}: loss {logs['loss']:.4f} (batch {self.batch})", flush=True
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)  # per rank: the job's spec.training.batchSize
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--output-dir", default="hf-trainer-out")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    data = Characters(corpus(), args.block, args.samples)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(data.vocab), n_positions=args.block, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        max_steps=args.max_steps,
        warmup_steps=10,
        logging_steps=args.log_every,
        save_strategy="no",  # the session checkpoints (every training.checkpoint.intervalSteps, at a stop)
        report_to="none",
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    progress = Progress(args.log_every, args.step_seconds)
    trainer = SGDJobTrainer(
        model=model,
        args=training,
        train_dataset=data,
        data_collator=progress.collate,
        callbacks=[progress],
    )
    rank, world = training.process_index, training.world_size
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"rank {rank}/{world} restart {restart}: starting at step {trainer.sgdjob.step_count}", flush=True)
    result = trainer.train()
    if rank == 0:
        print(f"done: {result.global_step} steps, last loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
