"""A torchrun worker for tests/trainer/test_rendezvous_rounds.py: joins a gloo world, appends
`formed <world size> <unix time>` to LOG (rank 0), then allreduces every 50 ms, so a peer that goes
away fails the step (and the agents start a new round); exits 0 once the file DONE exists."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    log, done = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        with log.open("a") as out:
            out.write(f"formed {world} {time.time():.3f} {os.environ.get('TORCHELASTIC_RESTART_COUNT')}\n")
    flag = torch.zeros(1)
    while True:
        flag.fill_(1.0 if done.exists() else 0.0)
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
