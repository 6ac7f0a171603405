"""The process's place in the job: torchrun's environment contract, the process group, logging.

torchrun (c10d rendezvous) sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RESTART_COUNT for every worker it starts. The node name
comes from NODE_NAME (the pod's spec.nodeName through the downward API), else the host name.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sgdjob_trainer.wire.launch_contract import ENV_NODE_NAME

log = logging.getLogger("sgdjob_trainer")

# Long enough for a slow group to catch up at a switch point on a loaded machine, short enough
# that a lost peer surfaces as an error (and a torchrun restart) instead of a silent hang.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


@dataclass(frozen=True, slots=True)
class WorldInfo:
    """Who this process is, as torchrun told it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    restart_count: int
    node: str

    @classmethod
    def from_env(cls) -> WorldInfo:
        return cls(
            rank=_env_int("RANK", 0),
            local_rank=_env_int("LOCAL_RANK", 0),
            world_size=_env_int("WORLD_SIZE", 1),
            local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
            group_rank=_env_int("GROUP_RANK", 0),
            restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
            node=os.environ.get(ENV_NODE_NAME) or socket.gethostname(),
        )


def choose_device(info: WorldInfo) -> torch.device:
    """One accelerator per local rank when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(info: WorldInfo, device: torch.device) -> None:
    """Join the job's process group: nccl on GPUs, gloo on CPUs (chosen by the device)."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        # A bare `python -m sgdjob_trainer` (no torchrun) trains alone; give it a private store.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size, timeout=COLLECTIVE_TIMEOUT)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def setup_logging(info: WorldInfo) -> None:
    """Rank 0 logs at INFO; the others only warnings and errors, so N processes do not drown it."""
    level = logging.INFO if info.rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{info.rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("sgdjob_trainer")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
