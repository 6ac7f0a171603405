"""SGDJob's adaptation API for a Hugging Face `transformers.Trainer` script (`pip install sgdjob[hf]`).

A script changes two lines: it imports `SGDJobTrainer` and makes its trainer with it instead of
`Trainer` (or mixes `SGDJobTrainerMixin` into its own Trainer subclass, first in the bases):

    from sgdjob_trainer.integrations.hf import SGDJobTrainer

    trainer = SGDJobTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.train()      # resumes from the session's newest checkpoint by itself

What it gives, as `adapt.start`/`session.loader`/`session.step` give a plain DDP script
(docs/adaptation-api.md, "Hugging Face Trainer"):

- The session: opened in `__init__`, after Trainer's Accelerator made the process group. An
  `SGDJobCallback` (added by the mixin) attaches it to the `DistributedDataParallel` model
  accelerate made (`trainer.model_wrapped`) at `on_train_begin`, before the first backward, and
  calls `session.step(loss)` at every `on_step_end` (one optimizer step: step, loss, wall time,
  the wait in DDP's exchange, hence the compute time the policy reads) and `session.finish()` at
  `on_train_end`.
- The batches: `get_train_dataloader` returns the session's loader (each rank its slice of one
  global batch a step, the split following a rebalance at an agreed step) instead of accelerate's
  sharded one. Trainer counts a whole epoch's steps from its length: `samples // global batch`,
  which no rebalance changes (the per-rank sizes sum to the global batch).
- The gradient of unequal per-rank batches weighed like the global batch's mean: the session's DDP
  communication hook scales each rank's mean gradient by its share (adapt/ddp.py). Trainer itself
  already normalises the loss by the global count of label tokens when the model takes loss kwargs
  and `average_tokens_across_devices` is on (the default for causal LMs such as GPT-2: the loss is
  the rank's token sum / the world's token count x world size); then `training_step` sets the
  hook's factor to 1 for that batch, so the weighting is not applied twice. Either way the averaged
  gradient is the global batch's mean. The reported loss is the rank's own mean in both cases.
- Hierarchical: the callback hands the session Trainer's optimizer at `on_train_begin`, so a
  `mode: hierarchical` command is followed as for a plain script; in it Trainer's count of the
  loss's items is the rank's group's, not the world's (`_get_num_items_in_batch`), so no world
  collective runs between the cross-group rounds.
- Checkpoints: the session's, through `save`/`load` functions of this module, not Trainer's
  `save_strategy`/`resume_from_checkpoint`. Why: the agreed stop happens inside `session.step()` at a
  step every rank agreed on, and the checkpoint written there must carry the session's state with the
  Trainer's (the split of the batch, the data position, the control epoch) in one directory the
  session verifies (size, sha256, COMPLETE written last) before resuming from it. Trainer's own
  checkpoint is written after the callbacks of the step, has no completeness marker, and its resume
  fast-forwards the data by `global_step % len(dataloader)` batches, which is wrong for a loader that
  resumes at its own position and a split that changed. One file holds the model's state_dict, the
  optimizer's and the LR scheduler's state, the TrainerState (global step, log history) and the CPU
  RNG state; the model's weights are loaded when the session opens, the rest at `on_train_begin`,
  after Trainer made its optimizer and scheduler. The directory: the job's `training.checkpoint.dir`;
  under plain torchrun `sgdjob_checkpoint_dir` (default `<output_dir>/sgdjob-checkpoints`). Keep
  `save_strategy="no"` unless you want Trainer's own checkpoints as well (they are not resumed from).

Refused, with an error naming the setting: `gradient_accumulation_steps` > 1 (a new split starts at a
batch boundary, which may fall inside an accumulation window whose micro-batches DDP exchanges once
with one weight), DeepSpeed and FSDP (the session weighs and times DDP's exchange only), DataParallel
over several GPUs in one process (`n_gpu` > 1), `auto_find_batch_size` (the job's batchSize is the
per-rank batch the policy splits), and an iterable train dataset (the loader cuts a map-style one).
`per_device_train_batch_size` must equal the job's `spec.training.batchSize`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from transformers import Trainer, TrainerCallback
except ImportError as err:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "sgdjob_trainer.integrations.hf needs transformers and accelerate: pip install 'sgdjob[hf]'"
    ) from err

from sgdjob_trainer import adapt
from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.integrations import ASYNC_REFUSED
from sgdjob_trainer.integrations.epochs import WholeEpochs

__all__ = ["SGDJobCallback", "SGDJobTrainer", "SGDJobTrainerMixin"]
log = logging.getLogger("sgdjob_trainer.integrations.hf")

# What of the TrainerState a resume takes back (the rest Trainer computes from its arguments).
_RESUMED_STATE = ("global_step", "epoch", "total_flos", "log_history", "num_input_tokens_seen")

if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


def refuse_unsupported(args: Any) -> None:
    """Raise ValueError naming the first TrainingArguments setting the integration cannot follow."""

    def no(setting: str, why: str) -> ValueError:
        return ValueError(f"SGDJobTrainer: TrainingArguments.{setting} is not supported: {why}")

    if int(args.gradient_accumulation_steps) != 1:
        raise no(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}",
            "a rebalance starts a new split at a batch boundary, which may fall inside an accumulation "
            "window whose micro-batches DDP exchanges once with one weight; use 1 and a larger "
            "per_device_train_batch_size (= the job's spec.training.batchSize)",
        )
    if getattr(args, "deepspeed", None):
        raise no("deepspeed", "the session weighs and times DDP's gradient exchange; DeepSpeed has its own")
    if getattr(args, "fsdp", None):
        raise no("fsdp", "the session weighs and times DDP's gradient exchange; FSDP has its own")
    if int(getattr(args, "n_gpu", 1)) > 1:
        raise no(f"n_gpu={args.n_gpu} (DataParallel)", "run one process per GPU under torchrun")
    if getattr(args, "auto_find_batch_size", False):
        raise no("auto_find_batch_size", "the job's spec.training.batchSize is the per-rank batch the policy splits")


class _WholeEpochs(WholeEpochs):
    """The session's loader as Trainer counts it (`WholeEpochs`: Trainer's max_steps and epochs do not
    shrink when the world resumes mid-epoch)."""

    def __init__(self, loader: AdaptiveLoader, dataset: Any) -> None:
        super().__init__(loader, dataset)  # Trainer.num_examples reads the dataset
        self.batch_size = loader.batch_size
        self.finished = False  # resumed at or past max_steps: nothing left to train

    def __iter__(self) -> Iterator[Any]:
        if not self.finished:
            yield from super().__iter__()


class SGDJobCallback(TrainerCallback):  # type: ignore[misc]
    """Connects the trainer's loop to its session; added by SGDJobTrainerMixin (it needs the trainer)."""

    def __init__(self, trainer: SGDJobTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        session = trainer.sgdjob
        model = trainer.model_wrapped
        if session.exchange is None:
            if isinstance(model, DistributedDataParallel):
                # Trainer made its optimizer by now (accelerate wraps it): with it the session can run
                # hierarchical, whose merge averages the optimizer's state over the ranks.
                optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
                session.attach(model, optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None)
            elif session.info.world_size > 1:
                raise TypeError(
                    f"SGDJobTrainer: the trainer's model is a {type(model).__name__}, not accelerate's "
                    "DistributedDataParallel: the session can neither weigh nor time its gradient exchange"
                )
        trainer._sgdjob_restore(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        loss, trainer._sgdjob_loss = trainer._sgdjob_loss, None
        trainer.sgdjob.step(loss)  # exits the process with 143 at an agreed stop, after the checkpoint

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.sgdjob.finish()


class SGDJobTrainerMixin(_TrainerBase):  # type: ignore[misc,valid-type]
    """Put it first in a Trainer subclass's bases. `sgdjob_checkpoint_dir`/`sgdjob_checkpoint_every`
    serve plain torchrun; the job's training.checkpoint wins."""

    def __init__(
        self,
        *args: Any,
        sgdjob_checkpoint_dir: str | None = None,
        sgdjob_checkpoint_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        refuse_unsupported(self.args)
        self._sgdjob_resumed: dict[str, Any] | None = None
        self._sgdjob_loader: _WholeEpochs | None = None
        self._sgdjob_loss: float | None = None
        if not torch.distributed.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _ = self.args.device  # makes accelerate's PartialState, which makes the process group
        directory = sgdjob_checkpoint_dir or os.path.join(self.args.output_dir, "sgdjob-checkpoints")
        self.sgdjob = adapt.start(
            None,
            save=self._sgdjob_save,
            load=self._sgdjob_load,
            checkpoint_dir=directory,
            checkpoint_every=sgdjob_checkpoint_every,
        )
        self.sgdjob.refuse_async(ASYNC_REFUSED)
        self.add_callback(SGDJobCallback(self))

    # -- the data -----------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """The session's loader (one per session: a second `train()` continues it)."""
        if self._sgdjob_loader is not None:
            return self._sgdjob_loader
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = self.train_dataset
        collator = self.data_collator
        if _is_datasets_dataset(dataset) and hasattr(self, "_remove_unused_columns"):
            dataset = self._remove_unused_columns(dataset, description="training")
        elif hasattr(self, "_get_collator_with_removed_columns"):
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        extra: dict[str, Any] = {}
        if args.dataloader_num_workers > 0:
            extra = {
                "num_workers": args.dataloader_num_workers,
                "persistent_workers": args.dataloader_persistent_workers,
            }
            if args.dataloader_prefetch_factor is not None:
                extra["prefetch_factor"] = args.dataloader_prefetch_factor
        if args.dataloader_pin_memory and torch.cuda.is_available():
            extra["pin_memory"] = True
        seed = args.data_seed if args.data_seed is not None else args.seed
        loader = self.sgdjob.loader(
            dataset, args.per_device_train_batch_size, shuffle=True, seed=seed, collate_fn=collator, **extra
        )
        self._sgdjob_loader = _WholeEpochs(loader, dataset)
        return self._sgdjob_loader

    # -- the step -----------------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's step, with the hook's weight set to 1 for a loss Trainer already normalised by the
        world's token count; notes the rank's mean loss for `session.step`."""
        items = args[0] if args else kwargs.get("num_items_in_batch")
        exchange = self.sgdjob.exchange
        share = 1.0
        if exchange is not None and self._sgdjob_loss_is_global(items):
            share, exchange.weight = exchange.weight, 1.0
        loss = super().training_step(model, inputs, *args, **kwargs)
        self._sgdjob_loss = float(loss) / share
        return loss

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: Any) -> Any:
        """Trainer's count of the items its loss is divided by. In hierarchical it is the rank's group's,
        summed over the group's own exchange and scaled by world / group size: Trainer multiplies the
        loss by the world size and the group's exchange averages over its ranks, so the group's gradient
        is its own items' mean. Trainer's count over the world (`average_tokens_across_devices`) would
        be a world collective a step, which holds the fast group to the slowest rank."""
        hierarchy, exchange = self.sgdjob.modes.hierarchy, self.sgdjob.exchange
        if hierarchy is None or exchange is None or not self.args.average_tokens_across_devices:
            return super()._get_num_items_in_batch(batch_samples, device)
        self.args.average_tokens_across_devices = False  # Trainer's own count, without its world gather
        try:
            count = super()._get_num_items_in_batch(batch_samples, device)
        finally:
            self.args.average_tokens_across_devices = True
        if not torch.is_tensor(count):
            return count
        total = count.detach().to(torch.float64).reshape(1)  # on the device the group's backend serves
        if exchange.group is not None:
            torch.distributed.all_reduce(total, group=exchange.group)
        scale = self.args.world_size / len(hierarchy.my_group)
        return (total[0] * scale).to(torch.float32)

    def _sgdjob_loss_is_global(self, items: Any) -> bool:
        """Trainer's own test (compute_loss): the loss is the rank's sum over the world's item count."""
        takes_kwargs = bool(getattr(self, "model_accepts_loss_kwargs", False))
        return (
            items is not None
            and bool(getattr(self.args, "average_tokens_across_devices", False))
            and (takes_kwargs or getattr(self, "compute_loss_func", None) is not None)
        )

    # -- checkpoints --------------------------------------------------------------------------------
    def _sgdjob_save(self, path: str) -> None:
        """Rank 0, at a step boundary the session chose: the Trainer's training state in one file."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "trainer_state": json.dumps({k: getattr(self.state, k, None) for k in _RESUMED_STATE}, default=str),
            "rng": torch.get_rng_state(),
        }
        torch.save(state, path)

    def _sgdjob_load(self, path: str) -> None:
        """Every rank, inside adapt.start: the weights now, the rest when Trainer has made its optimizer."""
        saved = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(saved["model"])
        self._sgdjob_resumed = saved

    def _sgdjob_restore(self, state: Any) -> None:
        """At on_train_begin: the optimizer, scheduler, step and RNG of the checkpoint the session loaded."""
        saved, self._sgdjob_resumed = self._sgdjob_resumed, None
        if saved is None:
            return
        if saved["optimizer"] is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        if saved["lr_scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        fields = json.loads(saved["trainer_state"])
        for key in _RESUMED_STATE:
            if fields.get(key) is not None:
                setattr(state, key, fields[key])
        # Trainer's loss logging counts from the step train() started at.
        self._globalstep_last_logged = self._initial_global_step = state.global_step
        torch.set_rng_state(saved["rng"])  # Trainer seeds every rank alike; so does a resume
        if self.sgdjob.step_count != state.global_step:
            log.warning(
                "the session resumed at step %d, the TrainerState at %d", self.sgdjob.step_count, state.global_step
            )
        if self._sgdjob_loader is not None and state.max_steps > 0 and state.global_step >= state.max_steps:
            self._sgdjob_loader.finished = True
        log.info("Trainer resumed at global step %d", state.global_step)


class SGDJobTrainer(SGDJobTrainerMixin, Trainer):  # type: ignore[misc]
    """`transformers.Trainer` on SGDJob's adaptation API (module docstring)."""


def _is_datasets_dataset(dataset: Any) -> bool:
    try:
        import datasets  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)
