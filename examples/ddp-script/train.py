"""A plain PyTorch DDP script in the style of the official tutorial ("Getting Started with
Distributed Data Parallel", and its elastic section's checkpoint/resume). Nothing in it knows about
SGDJob: run it with `torchrun --nproc-per-node=2 train.py` or as an SGDJob's `training.command`.

It trains a small MLP on a regression problem it makes itself (no downloads), saves a checkpoint
after every epoch and resumes from it when torchrun restarts the workers (a lost worker, a rescale).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(samples: int) -> TensorDataset:
    """y = sin(x . w) for a fixed w: the same data on every rank (same seed)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen)
    return TensorDataset(x, torch.sin(x @ w))


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The epoch to start from: 0, or the one after the checkpoint's."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]) + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    # Stands in for a bigger model's compute, so a short run lasts long enough to be interrupted.
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    # torchrun (or SGDJob's agent) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    first = load_checkpoint(args.checkpoint, model.module, optimizer)
    print(f"rank {rank}/{world} restart {restart}: starting at epoch {first}", flush=True)

    data = make_data(args.samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.MSELoss()
    mean = float("nan")  # a restart after the last epoch's checkpoint has nothing left to train
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        total, batches = torch.zeros(1), 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            batches += 1
            time.sleep(args.step_seconds)
        dist.all_reduce(total)
        mean = total.item() / (batches * world)
        if rank == 0:
            # Write, then rename: a worker killed mid-write must not leave a torn checkpoint.
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch}: loss {mean:.4f} (world {world}); checkpoint saved", flush=True)
        dist.barrier()  # every rank resumes from the same checkpoint after a restart
    if rank == 0:
        print(f"done: {args.epochs} epochs, last loss {mean:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
