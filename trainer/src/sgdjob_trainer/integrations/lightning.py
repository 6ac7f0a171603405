"""SGDJob's adaptation API for a PyTorch Lightning script (`pip install sgdjob[lightning]`).

A script changes two lines: it imports `SGDJobTrainer` and makes its trainer with it instead of
`lightning.Trainer`:

    from sgdjob_trainer.integrations.lightning import SGDJobTrainer

    trainer = SGDJobTrainer(max_steps=300, accelerator="cpu")   # devices/num_nodes from torchrun
    trainer.fit(model)   # resumes from the session's newest checkpoint by itself

What it gives, as `adapt.start`/`session.loader`/`session.step` give a plain DDP script
(docs/adaptation-api.md, "PyTorch Lightning"):

- The session: `fit` makes the process group from torchrun's environment (Lightning then uses it)
  and opens the session before Lightning's own fit, so the newest checkpoint the session verified is
  Lightning's `ckpt_path` and Lightning restores everything it saves (model, optimizers, schedulers,
  loops, callbacks). `SGDJobStrategy` (a `DDPStrategy`) hands Lightning that checkpoint without a
  second read and swaps the training DataLoader for the session's loader (`process_dataloader`).
- `SGDJobCallback` attaches the session to the `DistributedDataParallel` model at `on_fit_start` (the
  hook weighs unequal batches and times the exchange) with Lightning's optimizer, so the session can
  switch to hierarchical and back (one optimizer; with several it runs sync), reports each batch's optimizer step at
  `on_train_batch_end` (`session.step(loss)`, which may apply a rebalance, checkpoint or stop there),
  and finishes at `on_train_end`. It keeps SIGTERM for the session (an agreed stop), not Lightning's,
  and `SGDJobTrainer` skips Lightning's per-batch broadcast of its SIGTERM flag (a world collective).
- The batches: the session's loader with the DataLoader's dataset, batch size, shuffling (its
  DistributedSampler's or RandomSampler's, and its seed) and worker arguments. Its length is a whole
  epoch's steps (samples // global batch, the same under any split), so Lightning's per-epoch counts
  hold, and Lightning fetches no batch ahead of the one it trains (a sized loader is not prefetched).
- Checkpoints: the session's (`step-N/checkpoint.pt` is Lightning's full checkpoint dict), written
  at a step boundary all ranks agreed on, as Lightning's own ModelCheckpoint does at
  `on_train_batch_end`. Directory: the job's `training.checkpoint.dir`; under plain torchrun
  `sgdjob_checkpoint_dir` (default `<default_root_dir>/sgdjob-checkpoints`).

Refused, with an error naming the setting: `accumulate_grad_batches` > 1, a `strategy` of your own,
manual optimization, a `ddp_comm_hook`, `fit(ckpt_path=...)`, `devices`/`num_nodes` other than
torchrun's, a batch sampler of your own, a new dataset at a reload. The training DataLoader's
`batch_size` must equal the job's `spec.training.batchSize`.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

try:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import RunningStage
except ImportError as err:  # pragma: no cover - the extra is not installed
    raise ImportError("sgdjob_trainer.integrations.lightning needs lightning: pip install 'sgdjob[lightning]'") from err

from sgdjob_trainer import adapt
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.session import Session
from sgdjob_trainer.adapt.split import Position
from sgdjob_trainer.integrations import ASYNC_REFUSED
from sgdjob_trainer.integrations.epochs import WholeEpochs

__all__ = ["SGDJobCallback", "SGDJobStrategy", "SGDJobTrainer", "loader_arguments", "torchrun_layout"]
log = logging.getLogger("sgdjob_trainer.integrations.lightning")

# DataLoader attributes the session's loader takes over from the script's training DataLoader.
_PASSED_ON = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "persistent_workers")


def _refused(setting: str, why: str) -> ValueError:
    return ValueError(f"SGDJobTrainer: {setting} is not supported: {why}")


def torchrun_layout(environ: dict[str, str] | os._Environ[str], **given: Any) -> dict[str, int]:
    """`devices` and `num_nodes` of the world torchrun started (LOCAL_WORLD_SIZE processes on each of
    WORLD_SIZE / LOCAL_WORLD_SIZE agents; 1 and 1 without torchrun). A value the script gave must agree."""
    world = int(environ.get("WORLD_SIZE", "1"))
    local = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        raise ValueError(f"SGDJobTrainer: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    layout = {"devices": local, "num_nodes": world // local}
    for key, value in layout.items():
        if given.get(key) not in (None, "auto", value):
            raise _refused(
                f"{key}={given[key]!r}",
                f"torchrun started {world} processes, {local} per agent, so {key} is {value}; leave it out",
            )
    return layout


def loader_arguments(loader: DataLoader[Any]) -> tuple[bool, int, dict[str, Any]]:
    """(shuffle, seed, DataLoader arguments) of the script's training DataLoader, for session.loader."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise _refused(
            f"the training DataLoader's batch_sampler {type(batch_sampler).__name__}",
            "the session cuts each rank's batches of the global batch itself; give batch_size and a plain sampler",
        )
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        shuffle, seed = bool(sampler.shuffle), int(sampler.seed)
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):
        shuffle, seed = isinstance(sampler, RandomSampler), 0
    else:
        raise _refused(
            f"the training DataLoader's sampler {type(sampler).__name__}",
            "the session orders the data itself (shuffled or not); use shuffle=True or False",
        )
    extra = {name: getattr(loader, name) for name in _PASSED_ON}
    if loader.num_workers > 0:
        extra["prefetch_factor"] = loader.prefetch_factor
    else:
        extra.pop("persistent_workers")
    return shuffle, seed, extra


class _WholeEpochs(WholeEpochs):
    """The session's loader as Lightning counts it (`WholeEpochs`). Its state is the session's data
    position, which the session's own checkpoint metadata restores; Lightning's copy is checked."""

    def __init__(self, loader: AdaptiveLoader, session: Session, dataset: Any) -> None:
        super().__init__(loader, dataset)
        self.session = session

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.loader.resume_position(self.session.split).as_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = Position.from_dict(state["position"])
        if saved != self.loader.position:
            log.warning("Lightning's checkpoint has data position %s, the session's %s", saved, self.loader.position)


class SGDJobStrategy(DDPStrategy):
    """DDP whose training data is the session's loader, and whose checkpoint read at resume is the one
    the session verified. Made by SGDJobTrainer."""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is not None:
            raise _refused("ddp_comm_hook", "the session registers its own hook to weigh and time the exchange")
        super().__init__(**kwargs)
        self.sgdjob: Session | None = None
        self.resumed: tuple[str, dict[str, Any]] | None = None  # the checkpoint the session loaded
        self._epochs: _WholeEpochs | None = None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.resumed is not None and self.resumed[0] == str(checkpoint_path):
            saved, self.resumed = self.resumed[1], None
            return saved
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self.sgdjob is None:
            return dataloader
        if self._epochs is not None:  # Lightning asked the module again (reload_dataloaders_every_n_epochs)
            if getattr(dataloader, "dataset", None) is not self._epochs.dataset:
                raise _refused(
                    "a new training dataset after the first (reload_dataloaders_every_n_epochs)",
                    "the session's loader cuts one dataset for the whole run; return the same dataset",
                )
            return self._epochs
        if not isinstance(dataloader, DataLoader):
            raise _refused(
                f"a training dataloader of type {type(dataloader).__name__}",
                "give a torch DataLoader over a map-style dataset; the session cuts its batches",
            )
        if dataloader.batch_size is None:
            raise _refused("a training DataLoader without batch_size", "give batch_size (= spec.training.batchSize)")
        shuffle, seed, extra = loader_arguments(dataloader)
        loader = self.sgdjob.loader(dataloader.dataset, dataloader.batch_size, shuffle=shuffle, seed=seed, **extra)
        self._epochs = _WholeEpochs(loader, self.sgdjob, dataloader.dataset)
        return self._epochs


class SGDJobCallback(L.Callback):
    """Connects Lightning's loop to the session of its SGDJobStrategy; added by SGDJobTrainer."""

    def __init__(self) -> None:
        self._sigterm: Any = None

    @staticmethod
    def session_of(trainer: L.Trainer) -> Session:
        strategy = trainer.strategy
        if not isinstance(strategy, SGDJobStrategy) or strategy.sgdjob is None:
            raise TypeError("SGDJobCallback works with SGDJobTrainer only (its strategy opens the session)")
        return strategy.sgdjob

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.session_of(trainer)
            if not pl_module.automatic_optimization:
                raise _refused(
                    "manual optimization (automatic_optimization=False)",
                    "the session counts one optimizer step per batch; use automatic optimization",
                )
            self._sigterm = signal.getsignal(signal.SIGTERM)  # the session's, under SGDJob

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        session = self.session_of(trainer)
        model = trainer.strategy.model
        if session.exchange is None and isinstance(model, DistributedDataParallel):
            # Lightning made the optimizer by now; with one, the session can run hierarchical.
            optimizers = trainer.optimizers
            session.attach(model, optimizer=optimizers[0] if len(optimizers) == 1 else None)
        elif session.exchange is None and session.info.world_size > 1:
            raise TypeError(f"SGDJobTrainer: the model is a {type(model).__name__}, not DistributedDataParallel")

    def _keep_sigterm(self) -> None:
        """Lightning's own SIGTERM handler broadcasts from inside the signal; the session agrees a stop."""
        if callable(self._sigterm) and signal.getsignal(signal.SIGTERM) is not self._sigterm:
            signal.signal(signal.SIGTERM, self._sigterm)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._keep_sigterm()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._keep_sigterm()
        session = self.session_of(trainer)
        if session.step_count != trainer.global_step:
            log.warning("the session is at step %d, Lightning at %d", session.step_count, trainer.global_step)
        if trainer.global_step:
            log.info("Lightning resumed at global step %d", trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        # exits the process with 143 at an agreed stop, after the checkpoint
        self.session_of(trainer).step(loss if isinstance(loss, (torch.Tensor, float)) else None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.session_of(trainer).finish()


def _no_broadcast() -> None:
    """In place of Lightning's per-batch SIGTERM broadcast (SGDJobTrainer.__init__ says why)."""


class SGDJobTrainer(L.Trainer):
    """`lightning.Trainer` on SGDJob's adaptation API (module docstring). `sgdjob_checkpoint_dir` and
    `sgdjob_checkpoint_every` serve plain torchrun; the job's training.checkpoint wins."""

    def __init__(
        self,
        *,
        sgdjob_checkpoint_dir: str | None = None,
        sgdjob_checkpoint_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("strategy", "auto") not in ("auto", "ddp"):
            raise _refused(f"strategy={kwargs['strategy']!r}", "SGDJobTrainer brings its own DDP strategy; drop it")
        if int(kwargs.get("accumulate_grad_batches", 1)) != 1:
            raise _refused(
                f"accumulate_grad_batches={kwargs['accumulate_grad_batches']}",
                "a rebalance starts a new split at a batch boundary, which may fall inside an accumulation "
                "window; use 1 and a larger batch_size (= the job's spec.training.batchSize)",
            )
        kwargs.update(torchrun_layout(os.environ, devices=kwargs.get("devices"), num_nodes=kwargs.get("num_nodes")))
        kwargs["strategy"] = SGDJobStrategy()
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), SGDJobCallback()]
        super().__init__(**kwargs)
        # Lightning (2.5+) broadcasts from rank 0 at every batch whether its SIGTERM handler fired. Here
        # SIGTERM is the session's (an agreed stop), so that flag never is set, and the broadcast is a
        # world collective a step for nothing: it would hold hierarchical's fast group to the slowest rank.
        epoch_loop = self.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = _no_broadcast  # type: ignore[method-assign]
        self._sgdjob_dir = sgdjob_checkpoint_dir or os.path.join(self.default_root_dir, "sgdjob-checkpoints")
        self._sgdjob_every = sgdjob_checkpoint_every

    @property
    def sgdjob(self) -> Session:
        return SGDJobCallback.session_of(self)

    def fit(
        self,
        model: L.LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: Any = None,
        weights_only: bool | None = None,
    ) -> None:
        """Lightning's fit, resumed from the session's newest checkpoint (every rank calls it)."""
        if ckpt_path is not None:
            raise _refused(f"fit(ckpt_path={ckpt_path!r})", "the session resumes from its own checkpoints")
        strategy = self.strategy
        assert isinstance(strategy, SGDJobStrategy)
        if strategy.sgdjob is None:
            self._sgdjob_start(strategy)
        resumed = strategy.resumed[0] if strategy.resumed is not None else None
        super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path=resumed, weights_only=weights_only)

    def _sgdjob_start(self, strategy: SGDJobStrategy) -> None:
        if not dist.is_initialized() and self.world_size > 1:  # Lightning finds it made and uses it
            backend = "nccl" if strategy.root_device.type == "cuda" else "gloo"
            if backend == "nccl":  # this rank's GPU before its first collective (Lightning sets it later)
                torch.cuda.set_device(strategy.root_device)
            dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size)

        # Lightning's whole checkpoint (hparams included), which this job's rank 0 wrote and the session
        # verified (size, sha256): not weights only. Every rank, inside adapt.start; fit restores it.
        def load(path: str) -> None:
            strategy.resumed = (path, strategy.checkpoint_io.load_checkpoint(path, weights_only=False))

        def save(path: str) -> None:  # rank 0, at the step boundary the session chose
            torch.save(self._checkpoint_connector.dump_checkpoint(weights_only=False), path)

        strategy.sgdjob = adapt.start(
            None, save=save, load=load, checkpoint_dir=self._sgdjob_dir, checkpoint_every=self._sgdjob_every
        )
        strategy.sgdjob.refuse_async(ASYNC_REFUSED)
