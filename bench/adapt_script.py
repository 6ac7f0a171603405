"""The framework goodput benchmark's plain PyTorch DDP script on the adaptation API (`python -m
bench.goodput_frameworks --framework ddp`): examples/ddp-script-adapt/train.py's shape (DDP, its own
optimizer and loop, `adapt.start`, `session.loader`, `session.step`) with the benchmark's options,
which the HF and Lightning examples take too: --seed, an EMULATED straggler (--sample-seconds a sample
on every rank, --slow-factor x that on --slow-rank, slept before the backward pass), and rank 0's
validation every --validate-every of its steps into --output-dir/validation.jsonl (seconds since its
training began, its step, the held-out loss).

The task: a student MLP fits a fixed random teacher MLP's outputs (plus noise) on Gaussian inputs, so
the loss falls over hundreds of steps instead of a handful. The optimizer is SGD with momentum: in
async the trainer's parameter servers run it over the pushed gradients (docs/adaptation-api.md).
Runs under plain torchrun as well (the session then serves telemetry only).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from sgdjob_trainer import adapt

INPUTS = 32


def teacher_data(samples: int, seed: int) -> TensorDataset:
    """`samples` inputs drawn with `seed` and the teacher's noisy outputs (the teacher is the same for
    every seed: train and held-out sets differ in their inputs only)."""
    g = torch.Generator().manual_seed(1000)
    w1, w2 = torch.randn(INPUTS, 64, generator=g) / INPUTS**0.5, torch.randn(64, 1, generator=g) / 8
    x = torch.randn(samples, INPUTS, generator=torch.Generator().manual_seed(seed))
    y = torch.tanh(x @ w1) @ w2 * 4
    return TensorDataset(x, y + 0.1 * torch.randn(samples, 1, generator=torch.Generator().manual_seed(seed + 1)))


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)  # per rank: the job's spec.training.batchSize
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--val-samples", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)  # the model's initialisation and the data's order
    p.add_argument("--sample-seconds", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--validate-every", type=int, default=0)  # 0: no validation
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--output-dir", type=Path, default=Path("adapt-script-out"))
    return p.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(INPUTS, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    def save(path: str) -> None:
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)

    def load(path: str) -> None:
        state = torch.load(path, map_location="cpu")
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    session = adapt.start(model, optimizer=optimizer, save=save, load=load)
    loader = session.loader(teacher_data(args.samples, args.seed), batch_size=args.batch_size, shuffle=True, seed=0)
    heldout = teacher_data(args.val_samples, 10_000 + args.seed).tensors
    curve = None
    if rank == 0 and args.validate_every > 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        curve = (args.output_dir / "validation.jsonl").open("a")
    per_sample = args.sample_seconds * (args.slow_factor if rank == args.slow_rank else 1.0)
    loss_fn = nn.MSELoss()
    started = time.monotonic()
    done = False
    # In async another rank's end may reach this one at an epoch's end, and a meeting there may bring
    # its step count to --max-steps (the most any rank took): both end the loop before another step.
    while not done and not session.ending and session.step_count < args.max_steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            time.sleep(per_sample * len(x))
            loss.backward()
            optimizer.step()
            session.step(loss)
            step = session.step_count
            if curve is not None and step % args.validate_every == 0:
                with torch.no_grad():
                    held = float(loss_fn(net(heldout[0]), heldout[1]))
                curve.write(json.dumps({"time_s": time.monotonic() - started, "step": step, "loss": held}) + "\n")
                curve.flush()
            if rank == 0 and step % args.log_every == 0:
                print(f"step {step} ({session.telemetry.mode.value}): loss {loss.item():.4f}", flush=True)
            done = step >= args.max_steps
            if done:
                break
    session.finish()
    if rank == 0:
        print(f"done: {session.step_count} steps (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
