"""Run by tests/trainer/test_adapt_hierarchy.py under torchrun (4 gloo ranks): a script on the
adaptation API whose ranks claim two nodes of two ranks each (NODE_NAME, as the downward API sets it),
and an opt-in slow rank (an EMULATED straggler: it sleeps longer before its backward pass). Each rank
writes one JSON line a step to OUT/rank<R>.jsonl: the step, the mode the session is in, the wall
clock, its parameters and its momentum buffers. It trains until `--after-sync` steps after it came
back to sync from hierarchical (every rank sees the switch at the same step), or `--max-steps`."""

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


def arguments() -> argparse.Namespace:
    """The run's arguments (lightning_hierarchy_script.py takes the same); this rank's node named
    after its local rank, two ranks a node (as the downward API sets NODE_NAME)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.005)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--after-sync", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=400)
    os.environ["NODE_NAME"] = f"node-{int(os.environ['LOCAL_RANK']) // 2}"
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)  # momentum: state to average

    def save(path: str) -> None:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)

    def load(path: str) -> None:
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    session = adapt.start(model, optimizer=optimizer, save=save, load=load)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(4096, 1, generator=g)
    loader = session.loader(TensorDataset(x, y), batch_size=8, shuffle=True, seed=0)
    pause = args.slow_seconds if rank == args.slow_rank else args.step_seconds
    loss_fn = nn.MSELoss()
    was_hierarchical, back_at = False, None
    with (args.out / f"rank{rank}.jsonl").open("w") as out:
        while back_at is None or session.step_count < back_at + args.after_sync:
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                time.sleep(pause)
                loss.backward()
                optimizer.step()
                session.step(loss)
                mode = session.telemetry.mode.value
                momentum = [optimizer.state[p]["momentum_buffer"].flatten().tolist() for p in model.parameters()]
                params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
                doc = {"step": session.step_count, "mode": mode, "t": time.time(), "params": params}
                out.write(json.dumps({**doc, "momentum": momentum}) + "\n")
                was_hierarchical = was_hierarchical or mode == "hierarchical"
                if back_at is None and was_hierarchical and mode == "sync":
                    back_at = session.step_count
                done = back_at is not None and session.step_count >= back_at + args.after_sync
                if done or session.step_count >= args.max_steps:
                    break
            if session.step_count >= args.max_steps:
                break
    session.finish()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    (args.out / f"final{rank}.json").write_text(json.dumps(params))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
