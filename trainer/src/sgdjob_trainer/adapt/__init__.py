"""SGDJob's adaptation API: a few lines that let a plain torchrun DDP script be adapted by SGDJob
(spec.training.command with spec.training.adaptation: api). docs/adaptation-api.md is the contract.

    from sgdjob_trainer import adapt

    dist.init_process_group("gloo")
    model = DDP(net)
    session = adapt.start(model, save=save_fn, load=load_fn)   # resumes: load_fn(newest checkpoint)
    loader = session.loader(dataset, batch_size=32)            # this rank's share of the global batch
    for epoch in range(loader.epoch, epochs):
        for x, y in loader:
            ... forward, backward, optimizer.step() ...
            session.step(loss)                                 # report; act at the step boundary
    session.finish()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.session import Session, open_session

__all__ = ["AdaptiveLoader", "Session", "start"]


def start(
    model: Any = None,
    *,
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
    without one."""
    return open_session(model, save, load, checkpoint_dir, checkpoint_every)
