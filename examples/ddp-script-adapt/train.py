"""examples/ddp-script/train.py on SGDJob's adaptation API (docs/adaptation-api.md): the same DDP
script plus the session's lines. Run it as an SGDJob (`sgdjob run examples/ddp-script-adapt/job.yaml`,
training.adaptation: api) and the policy may rebalance its per-rank batch; run it with plain
`torchrun --nproc-per-node=2 train.py` and it trains as before, serving telemetry only.

It trains a small MLP on a regression problem it makes itself (no downloads). The session writes its
checkpoints (every training.checkpoint.intervalSteps and at an agreed stop) through save_checkpoint
and resumes from the newest through load_checkpoint when torchrun restarts the workers.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from sgdjob_trainer import adapt


def make_data(samples: int) -> TensorDataset:
    """y = sin(x . w) for a fixed w: the same data on every rank (same seed)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen)
    return TensorDataset(x, torch.sin(x @ w))


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--checkpoint", default="checkpoints")  # a directory; a job's checkpoint.dir wins
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
    session = adapt.start(
        model,
        optimizer=optimizer,  # leaving hierarchical averages its state over the ranks
        save=lambda path: save_checkpoint(path, model.module, optimizer),
        load=lambda path: load_checkpoint(path, model.module, optimizer),
        checkpoint_dir=args.checkpoint,
    )

    data = make_data(args.samples)
    loader = session.loader(data, batch_size=args.batch_size, shuffle=True, seed=0)
    step = session.step_count
    print(f"rank {rank}/{world} restart {restart}: starting at epoch {loader.epoch}, step {step}", flush=True)
    loss_fn = nn.MSELoss()
    mean = float("nan")  # a restart after the last epoch's checkpoint has nothing left to train
    for epoch in range(loader.epoch, args.epochs):
        total, batches = torch.zeros(1), 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            batches += 1
            time.sleep(args.step_seconds)
            session.step(loss)
        dist.all_reduce(total)
        mean = total.item() / (batches * world)
        if rank == 0:
            print(f"epoch {epoch}: loss {mean:.4f} (world {world}, batch {loader.batch_size})", flush=True)
    session.finish()
    if rank == 0:
        print(f"done: {args.epochs} epochs, last loss {mean:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
