"""A Hugging Face Trainer script on SGDJob's adaptation API (docs/adaptation-api.md, "Hugging Face
Trainer"): a tiny GPT-2 (2 layers, 64 wide, built from a config: nothing is downloaded) learns a
character-level language model of the docstrings of a few standard-library modules.

What makes it an SGDJob script is two lines: the import of SGDJobTrainer and `SGDJobTrainer(...)` in
place of `Trainer(...)`. Run it as an SGDJob (`sgdjob run examples/hf-trainer/job.yaml`,
training.adaptation: api) and the policy may rebalance its per-rank batch, and an agreed stop
checkpoints and resumes it; run it with plain `torchrun --nproc-per-node=2 train.py` and it trains as
any Trainer script, serving telemetry only and resuming from --output-dir/sgdjob-checkpoints.

Two opt-in extras serve bench/goodput_frameworks.py (off by default): an EMULATED straggler
(`--sample-seconds S --slow-rank R --slow-factor K`: every rank sleeps S seconds per sample of the
batch it just trained on, rank R K times that, so a smaller batch really makes it faster) and a
validation (`--validate-every N`: rank 0 writes the loss on held-out windows no rank trains on to
--output-dir/validation.jsonl every N steps, with the seconds since training began).
"""

from __future__ import annotations

import argparse
import inspect
import json
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

    def __init__(self, text: str, block: int, samples: int, skip: int = 0) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        windows = ids[: len(ids) // block * block].view(-1, block)
        self.windows = windows[skip : skip + samples]

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


def emulate_compute(model: torch.nn.Module, per_sample: float) -> None:
    """Sleep `per_sample` seconds a sample of each training forward (an EMULATED slower accelerator).
    In the forward, where a slow device spends its time: Trainer gathers the batch's token count
    across ranks before it, so a sleep outside forward/backward would make the other ranks wait in
    that gather, which the session does not time, instead of in DDP's exchange, which it does."""

    def sleep(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if module.training and inputs is not None:
            time.sleep(per_sample * len(inputs))

    model.register_forward_pre_hook(sleep, with_kwargs=True)


class Validation(TrainerCallback):  # type: ignore[misc]
    """Rank 0, every `every` steps: the mean loss on `data` (windows no rank trains on), appended to
    `path` as a JSON line with the step and the seconds since training began on this rank."""

    def __init__(self, data: Characters, every: int, path: str) -> None:
        self.inputs, self.every, self.path = data.windows, every, path
        self.start = time.monotonic()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every or model is None:
            return
        model.eval()
        with torch.no_grad():  # the bare model, not DDP's wrapper: no collective on rank 0 alone
            loss = float(model(input_ids=self.inputs.to(model.device), labels=self.inputs.to(model.device)).loss)
        model.train()
        row = {"time_s": round(time.monotonic() - self.start, 4), "step": state.global_step, "loss": loss}
        with open(self.path, "a") as out:
            out.write(json.dumps(row) + "\n")


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
    parser.add_argument("--seed", type=int, default=0)  # the model's initialisation and the data's order
    parser.add_argument("--sample-seconds", type=float, default=0.0)  # emulated compute a sample, every rank
    parser.add_argument("--slow-rank", type=int, default=-1)  # this rank's per-sample sleep is --slow-factor x
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--validate-every", type=int, default=0)  # 0: no validation
    parser.add_argument("--val-samples", type=int, default=128)  # held-out windows, after the trained ones
    args = parser.parse_args()

    text = corpus()
    data = Characters(text, args.block, args.samples)
    torch.manual_seed(args.seed)
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
        seed=args.seed,
    )
    if args.sample_seconds > 0:
        slow = int(os.environ.get("RANK", "0")) == args.slow_rank
        emulate_compute(model, args.sample_seconds * (args.slow_factor if slow else 1.0))
    progress = Progress(args.log_every, args.step_seconds)
    callbacks: list[TrainerCallback] = [progress]
    if args.validate_every > 0 and progress.rank == 0:
        heldout = Characters(text, args.block, args.val_samples, skip=len(data))
        if len(heldout) == 0:
            parser.error(f"no held-out windows are left after --samples {args.samples}")
        path = os.path.join(args.output_dir, "validation.jsonl")
        os.makedirs(args.output_dir, exist_ok=True)
        callbacks.append(Validation(heldout, args.validate_every, path))
    trainer = SGDJobTrainer(
        model=model,
        args=training,
        train_dataset=data,
        data_collator=progress.collate,
        callbacks=callbacks,
    )
    rank, world = training.process_index, training.world_size
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"rank {rank}/{world} restart {restart}: starting at step {trainer.sgdjob.step_count}", flush=True)
    result = trainer.train()
    if rank == 0:
        print(f"done: {result.global_step} steps, last loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
