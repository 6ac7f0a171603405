"""SGDJob's adaptation API: a few lines that let a plain torchrun DDP script be adapted by SGDJob
(spec.training.command with spec.training.adaptation: api). docs/adaptation-api.md is the contract.

    from sgdjob_trainer import adapt

    dist.init_process_group("gloo")
    model = DDP(net)
    session = adapt.start(model, optimizer=opt, save=save_fn, load=load_fn)  # resumes: load_fn(newest)
    loader = session.loader(dataset, batch_size=32)            # this rank's share of the global batch
    for epoch in range(loader.epoch, epochs):
        for x, y in loader:
            ... forward, backward, optimizer.step() ...
            session.step(loss)                                 # report; act at the step boundary
    session.finish()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.session import Session
from sgdjob_trainer.adapt.settings import Settings, read_run_config, settings
from sgdjob_trainer.runtime import WorldInfo, setup_logging
from sgdjob_trainer.server import metrics_port
from sgdjob_trainer.wire.launch_contract import ENV_RUN_CONFIG

__all__ = ["AdaptiveLoader", "Session", "start"]
log = logging.getLogger("sgdjob_trainer.adapt")


def start(
    model: Any = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    save: Callable[[str], None] | None = None,
    load: Callable[[str], None] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
) -> Session:
    """This process's session, after `torch.distributed.init_process_group` and before the first step
    (collective: every rank calls it). `model`: the DistributedDataParallel model, whose exchange it
    weighs and times. `save(path)` writes the script's state to `path` (rank 0), `load(path)` reads it
    back (every rank, at once here when a checkpoint exists). The job's training.checkpoint gives
    the directory and interval; `checkpoint_dir`/`checkpoint_every` serve plain torchrun and a job
    without one. `optimizer`: the script's, whose state leaving hierarchical mode averages over the
    ranks; without it a command for hierarchical is refused (the script runs sync)."""
    info = WorldInfo.from_env()
    if dist.is_initialized():  # the group the script made is the world, whatever the environment says
        info = dataclasses.replace(info, rank=dist.get_rank(), world_size=dist.get_world_size())
    elif info.world_size > 1:
        raise RuntimeError("adapt.start: call torch.distributed.init_process_group first (WORLD_SIZE > 1)")
    setup_logging(info)
    config = read_run_config(os.environ)
    chosen = settings(config, checkpoint_dir, checkpoint_every)
    port = metrics_port(chosen.training, info.local_rank)
    comm = Comm.for_world(info.world_size)
    session = Session(info, chosen, comm, save=save, load=load, optimizer=optimizer, port=port)
    if isinstance(model, DistributedDataParallel):
        session.attach(model)
    elif model is not None and info.world_size > 1:
        raise TypeError("adapt.start(model): give the DistributedDataParallel model (or None)")
    if chosen.managed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: session.request_stop())
    if info.rank == 0:
        _say_once(chosen, session)
    return session


def _say_once(chosen: Settings, session: Session) -> None:
    where = f"on port {session.server.port}" if session.server is not None else "(no server)"
    saves = f"checkpoints in {session.checkpoint_dir}" if session.checkpoint_dir is not None else "no checkpoints"
    if not chosen.managed:
        log.warning(
            "sgdjob adapt: not started by SGDJob (no %s): telemetry only %s; no control, no agreed stop; %s",
            ENV_RUN_CONFIG,
            where,
            saves,
        )
    elif not chosen.adapted:
        log.warning(
            "sgdjob adapt: the job's spec.training.adaptation is not 'api': its controller does not adapt this "
            "script; telemetry %s, %s",
            where,
            saves,
        )
    else:
        log.info("sgdjob adapt: job %s, telemetry and control %s, %s", chosen.job_name, where, saves)
