"""The adaptation API's session: what a torchrun script adds to report to SGDJob and follow it.

The imperative shell around split.py. It serves the trainer's per-rank HTTP server (server.py:
/metrics, /status, /healthz, and /control on rank 0) from the trainer's Telemetry, so a controller
scrapes and commands a script as it does the trainer. At each `step()` it records the step, and, when
SGDJob runs the script, agrees with the other ranks on what happens at this step boundary:

- Each step starts a small MAX-allreduce of [rank 0's pending control epoch, a stop asked for]
  on the session's gloo group, and waits for the previous step's: every rank reads the same round
  at the same step, and its latency hides behind a step of compute.
- A newer epoch: rank 0 broadcasts the command it holds (merged, as the trainer's inbox merges) and
  every rank applies it (`split.apply_command`): the split of the batch reaches the loader, and
  what cannot be applied is refused in /status `controlError`, the epoch still counted as applied.
- A stop (SIGTERM on any rank, or `request_stop()`): at that step rank 0 writes a checkpoint, every
  rank writes its report and the process exits 143, as the trainer does, so torchrun restarts
  the world from the checkpoint instead of counting the stop as success.
- Every `intervalSteps` steps rank 0 writes a checkpoint (in sync every rank passes every step).
- A `mode: async` command (modes.py, asynchronous.py): the script's optimizer step pushes to the
  parameter servers, the batches come from one queue, and the agreement rides the servers' replies:
  a rank that reads a newer epoch, a stop, another rank's end or a checkpoint's call in a reply meets
  the others at its step boundary (`_meet`), where the world does it in sync's terms and goes on in
  async. The ranks take different numbers of steps there; a meeting agrees on the most.
- A `mode: hierarchical` command (modes.py, hierarchy.py): the hook allreduces within the rank's
  group, the model is averaged across groups every averageEvery steps, and the agreement above
  rides those rounds instead of running every step; leaving it, a checkpoint, the stop and
  `finish()` merge every rank to one model and optimizer state first. A checkpoint taken in
  hierarchical resumes in it, with its groups where the new world still has them.

Under plain torchrun (no run-config from SGDJob) it serves telemetry only and says so once:
no control, no agreed stop; checkpoints only when the script passes a directory.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from sgdjob_trainer.adapt import checkpoints
from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.adapt.ddp import Exchange
from sgdjob_trainer.adapt.hierarchy import RoundOutcome
from sgdjob_trainer.adapt.loader import OWN_ARGUMENTS, AdaptiveLoader
from sgdjob_trainer.adapt.modes import AsyncHooks, Modes
from sgdjob_trainer.adapt.settings import Settings
from sgdjob_trainer.adapt.split import Position, Split, apply_command, prefetch_lag
from sgdjob_trainer.checkpoint import check_shared, claim_dir, remove_stale
from sgdjob_trainer.config import Compression, SyncMode, initial_batches
from sgdjob_trainer.recovery import EXIT_STOPPED, start_stop_watchdog
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.server import ControlInbox, TrainerServer
from sgdjob_trainer.strategies.base import exchange_bytes
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import ENV_METRICS_HOST, ENV_REPORT_DIR

log = logging.getLogger("sgdjob_trainer.adapt")


class Session:
    """One per process; made by `start()` (adapt/__init__.py), after init_process_group."""

    def __init__(
        self,
        info: WorldInfo,
        settings: Settings,
        comm: Comm,
        *,
        save: Callable[[str], None] | None = None,
        load: Callable[[str], None] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        port: int | None = 0,
    ) -> None:
        if (save is None) != (load is None):
            raise ValueError("adapt.start: give both save and load (or neither, for no checkpoints)")
        self.info, self.settings, self.comm = info, settings, comm
        self.save_fn, self.load_fn = save, load
        training = settings.training
        self.telemetry = Telemetry(info, SyncMode.SYNC, training.batch_size)
        self.inbox = ControlInbox() if info.rank == 0 and settings.managed else None
        self.stopping = threading.Event()
        hooks = AsyncHooks(
            lambda: self.step_count,
            self.stopping.is_set,
            self.inbox.pending_epoch if self.inbox is not None else (lambda: 0),
            lambda: self.split,
        )
        self.modes = Modes(info, comm, self.telemetry, training.hierarchical, optimizer, training.async_, hooks)
        self._resumed_groups: list[list[int]] | None = None  # a checkpoint taken in hierarchical
        # A checkpoint taken in async, or a job that starts in async: entered once attach() and loader() are done.
        self._enter_async = settings.start_mode == SyncMode.ASYNC
        self._met = 0  # in async: the newest call to meet every rank has met for (ps.MEET)
        self.ending = False  # in async: another rank's training is over; the loader hands out no more
        self.telemetry.restart_count = info.restart_count
        self.server: TrainerServer | None = None
        if port is not None:
            try:
                self.server = TrainerServer(
                    self.telemetry, self.inbox, os.environ.get(ENV_METRICS_HOST, "0.0.0.0"), port
                )
                self.server.start()
            except RuntimeError as err:
                if settings.managed:  # its controller scrapes this port: a job without it would fly blind
                    raise
                log.warning("%s; going on without the telemetry server", err)
        self.split = Split.of(info.world_size, training.batch_size, initial_batches(training, info.world_size))
        self.position = Position()
        self.step_count = 0
        self.applied_epoch = 0
        self.loader_made: AdaptiveLoader | None = None
        self.exchange: Exchange | None = None
        self.finishing = False
        self._round: Callable[[], list[int]] | None = None
        self._last_checkpoint = 0
        self._last_end = time.perf_counter()
        self._step_start: float | None = None
        self._taken = 0  # samples handed out by the loader since the last step
        self._slowest = 0.0
        self._began = False
        self.life = str(comm.broadcast(uuid.uuid4().hex[:12]))
        self.checkpoint_dir = settings.checkpoint_dir if save is not None else None
        if self.checkpoint_dir is not None:
            self._resume(self.checkpoint_dir)

    # -- the API ------------------------------------------------------------------------------------
    def attach(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Weigh and time the model's gradient exchange (ddp.py). Before its first backward pass.
        `optimizer`: for a framework that makes it after `adapt.start` (as `adapt.start(optimizer=)`)."""
        if self.exchange is not None:
            raise RuntimeError("the session is attached to a model already")
        if optimizer is not None:
            self.modes.optimizer = optimizer
        self.exchange = Exchange(model, self._computed)  # weight 1 until the loader hands out a batch
        self.modes.attach(model, self.exchange)
        self.telemetry.set_gradient_bytes(exchange_bytes(list(model.parameters()), Compression.NONE))
        if self._resumed_groups is not None and self.modes.obstacle() is None:
            # The stored command's epoch counts as applied: no controller re-sends it.
            self.modes.switch(SyncMode.HIERARCHICAL, self._resumed_groups, "resumed in hierarchical", self.step_count)
        self._enter_async_when_ready()

    def refuse_async(self, reason: str) -> None:
        """A framework integration whose training loop async is not checked with: the policy never
        proposes async (sgdjob_async_capable 0) and a command for it is refused with `reason`."""
        self.modes.async_refusal = reason
        self.modes.note_async()

    def loader(
        self, dataset: Dataset[Any], batch_size: int, *, shuffle: bool = True, seed: int = 0, **loader_args: Any
    ) -> AdaptiveLoader:
        """This rank's batches of one global batch a step (loader.py); `loader_args` go to the DataLoader.
        Collective: every rank calls it at the same point."""
        if self.loader_made is not None:
            raise RuntimeError("one session.loader per session: it is the training data the split cuts")
        if own := sorted(OWN_ARGUMENTS & loader_args.keys()):
            raise TypeError(f"session.loader cuts the batches itself; do not pass {', '.join(own)}")
        training = self.settings.training
        if self.settings.managed and batch_size != training.batch_size:
            raise ValueError(
                f"session.loader(batch_size={batch_size}) differs from the job's spec.training.batchSize "
                f"{training.batch_size}: the policy splits batchSize x world among the ranks; make them equal"
            )
        samples = len(dataset)  # type: ignore[arg-type]
        lag = prefetch_lag(int(loader_args.get("num_workers", 0)), loader_args.get("prefetch_factor"))
        # Every rank must cut the same global batches: the same data, and the same lag for a new split.
        lag, most, fewest = self.comm.all_max([lag, samples, -samples])
        if most != -fewest:
            raise ValueError(f"the ranks' datasets differ in length ({-fewest}..{most} samples): give every rank one")
        if not self.settings.managed:  # no job says the batch, and no controller changes it
            self.split = Split.of(self.info.world_size, batch_size)
        if self.split.total > samples:
            raise ValueError(f"a global batch of {self.split.total} is more than the dataset's {samples} samples")
        self.loader_made = AdaptiveLoader(
            dataset,
            rank=self.info.rank,
            split=self.split,
            position=self.position,
            shuffle=shuffle,
            seed=seed,
            lag=lag,
            on_fetch=self._fetching,
            on_batch=self._handed_out,
            **loader_args,
        )
        self.telemetry.set_batch_size(self.split.size(self.info.rank))
        self.modes.set_loader(self.loader_made)
        self.loader_made.ending = lambda: self.ending
        self.loader_made.on_epoch_end = self._epoch_end
        self._enter_async_when_ready()
        return self.loader_made

    def step(self, loss: Any = None, samples: int | None = None) -> None:
        """One optimizer step is done: record it (loss: a float or a 1-element tensor; samples: this
        rank's, by default what the loader handed out since the last step) and act at this step
        boundary. Exits the process with 143 at an agreed stop, after the checkpoint."""
        self._begin()
        offer = self.inbox.pending_epoch() if self.inbox is not None else 0
        rounds = self.modes.round(offer, self.stopping.is_set())
        now = time.perf_counter()
        wall = now - (self._step_start if self._step_start is not None else self._last_end)
        wait = (self.exchange.take_wait() if self.exchange is not None else 0.0) + rounds.waited
        taken = samples if samples is not None else self._taken or self.split.size(self.info.rank)
        if self.modes.discarded():
            taken = 0  # not useful work: the shards threw the gradient away
        value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss) if loss is not None else math.nan
        if math.isnan(self.telemetry.initial_loss):
            self.telemetry.initial_loss = value  # this life's first: the report's loss from -> to
        self.step_count += 1
        age = self.modes.age()
        self.telemetry.record_step(self.step_count, taken, max(wall - wait, 0.0), wait, wall, value, age)
        self.telemetry.computing = False
        self._slowest = max(self._slowest, wall)
        self._boundary(rounds)
        self._last_end, self._step_start, self._taken = time.perf_counter(), None, 0

    def request_stop(self) -> None:
        """Stop at the next agreed step with a checkpoint, as SIGTERM does (any rank may ask)."""
        if not self.stopping.is_set():
            self.stopping.set()
            start_stop_watchdog(lambda: self.step_count, lambda: self.finishing, lambda: self._slowest)

    def finish(self) -> None:
        """Training is over: the final checkpoint (training.checkpoint.onStop), the rank's report, the
        server stopped. Every rank calls it (collective)."""
        if self.finishing:
            return
        self.finishing = True
        if self._round is not None:
            self._round()  # every rank started it at its last step
            self._round = None
        if self.modes.stay is not None:  # the others stop at their next push, and meet here
            self.modes.stay.server.end()
            self._meet(0, False, finishing=True)
        self.modes.leave("training finished", self.step_count)  # the script's model after training is one
        if self.settings.training.checkpoint.on_stop:
            self._checkpoint()
        self._end()
        self.modes.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.finish()

    # -- step boundaries ----------------------------------------------------------------------------
    def _boundary(self, rounds: RoundOutcome) -> None:
        if self.modes.asynchronous:
            self._async_boundary()
        else:
            self._sync_boundary(rounds)
        self._start_round()

    def _start_round(self) -> None:
        """In sync, the next step's agreement. Every rank starts one at every step boundary in sync, and
        one at a meeting that ends in sync (a rank may meet at its epoch's end, outside a step), so
        every rank has started the same rounds at every step."""
        if self.settings.managed and self.modes.mode == SyncMode.SYNC and not self.ending and self._round is None:
            offer = self.inbox.pending_epoch() if self.inbox is not None else 0
            self._round = self.comm.start_round([offer, int(self.stopping.is_set())])

    def _sync_boundary(self, rounds: RoundOutcome) -> None:
        if self.settings.managed:
            if self.modes.hierarchical or self._round is None:
                seen, stop = rounds.epoch, int(rounds.stop)
            else:
                seen, stop = self._round()
            self._round = None
            if stop:
                self._stop_here()
            if seen > self.applied_epoch:
                self._receive()
        if self.step_count - self._last_checkpoint >= self.settings.checkpoint_every:
            self._checkpoint()

    def _async_boundary(self) -> None:
        """In async: meet the other ranks here if the shards' reply, or this rank, asks for it."""
        stay = self.modes.stay
        if stay is None:
            return
        reply = stay.reply
        if reply.stop and not reply.interrupted:  # another rank is done: meet it in its finish() now
            self._meet(0, False, finishing=True)
            return
        due = self.step_count - self._last_checkpoint >= self.settings.checkpoint_every
        if due and self.checkpoint_dir is not None and reply.checkpoint <= self._met:
            stay.server.meet(self._met + 1)
        called = reply.checkpoint > self._met or (due and self.checkpoint_dir is not None)
        if reply.epoch > self.applied_epoch or reply.interrupted or self.stopping.is_set() or called:
            self._meet(reply.epoch, reply.interrupted or self.stopping.is_set())

    def _epoch_end(self) -> None:
        """The loader's epoch is over: in async every rank meets there (the queue ends every rank's epoch
        within a batch), so what a script does between epochs, its collectives among it, finds every
        rank there with one model, the server's."""
        stay = self.modes.stay
        if stay is not None and not self.ending:
            self._meet(stay.reply.epoch, stay.reply.interrupted or self.stopping.is_set())
            self._step_start = None  # the next step's clock starts at its own fetch, after the meeting

    def _meet(self, epoch: int, stop: bool, finishing: bool = False) -> None:
        """Collective in async, each rank at its own step boundary (or its epoch's end, or finish()): the
        stay pauses (every rank holds the server's model at the queue's position, at the most steps any
        rank took), the world does what the meeting is for as sync does, and a new stay begins if the
        mode is still async. A rank that finished ends every rank's training here."""
        steps, stopped, _, done = self.comm.all_max([self.step_count, int(stop), epoch, int(finishing)])
        self.modes.pause()
        self.step_count = steps
        self._met += 1
        if done:  # at the most steps, the loader handing out no more: every rank's loop ends
            self.ending = True
            self.modes.leave("training finished", self.step_count)
            return
        if stopped:
            self._stop_here()
        if self.settings.managed:
            self._receive()  # an epoch any rank saw is rank 0's pending one (nothing new: a no-op)
        if self.step_count - self._last_checkpoint >= self.settings.checkpoint_every:
            self._checkpoint()
        self.modes.resume()
        self._start_round()

    def _receive(self) -> None:
        """Collective: rank 0's newest command, applied on every rank."""
        mine = self.inbox.take() if self.inbox is not None else None
        doc = self.comm.broadcast(mine.model_dump(mode="json", by_alias=True) if mine is not None else None)
        if doc is None:
            return
        command = ControlCommand.model_validate(doc)
        loader = self.loader_made
        samples = loader.samples if loader is not None else None
        why = self.modes.obstacle() if command.mode == SyncMode.HIERARCHICAL else None
        unasync = self.modes.async_obstacle() if command.mode == SyncMode.ASYNC else None
        applied = apply_command(self.split, command, samples, why, unasync)
        if applied.split != self.split:
            self.split = applied.split
            if loader is not None:  # in async: the stay paused at this meeting resumes with it
                loader.resplit(applied.split)
        if applied.mode is not None:
            reason = command.reason or f"control epoch {command.epoch}"
            self.modes.switch(applied.mode, command.groups, reason, self.step_count)
        self.applied_epoch = command.epoch
        if self.inbox is not None:
            self.inbox.mark_applied(command.epoch)
        self.telemetry.set_control_epoch(command.epoch, applied.refused)
        self.telemetry.set_batch_size(self.split.size(self.info.rank))
        log.info(
            "control epoch %d at step %d: batch sizes %s (%s)",
            command.epoch,
            self.step_count,
            self.split.as_dict(),
            command.reason or "no reason given",
        )
        if applied.refused:
            log.warning("control epoch %d: %s", command.epoch, applied.refused)

    def _stop_here(self) -> None:
        """The agreed stop: every rank is at this step; rank 0 checkpoints, every rank exits 143."""
        self.finishing = True
        if self.settings.training.checkpoint.on_stop:
            self._checkpoint()
        log.warning("stopped at the agreed step %d%s", self.step_count, self._checkpoint_note())
        self._end()
        raise SystemExit(EXIT_STOPPED)  # the script's process group is its own: left to the process's exit

    def _checkpoint(self) -> None:
        due = self.step_count > self._last_checkpoint
        self._last_checkpoint = self.step_count
        if self.checkpoint_dir is None or self.save_fn is None or not due:
            return
        self.modes.merge()  # in hierarchical: every rank is here at this step, and saves the merged model
        if self.info.rank != 0:
            return
        state = {"control_epoch": self.applied_epoch, "batch_sizes": self.split.as_dict(), "position": self._at()}
        state["groups"] = self.modes.groups
        state["async"] = self.modes.asynchronous
        start = time.perf_counter()
        checkpoints.write(
            self.checkpoint_dir,
            self.step_count,
            self.life,
            self.save_fn,
            state,
            self.info.world_size,
            self.settings.training.checkpoint.keep,
        )
        log.info("checkpoint of step %d written in %.2f s", self.step_count, time.perf_counter() - start)

    def _checkpoint_note(self) -> str:
        return " after a checkpoint" if self.checkpoint_dir is not None else " (no checkpoint directory)"

    def _at(self) -> dict[str, int]:
        loader = self.loader_made
        return (loader.resume_position(self.split) if loader is not None else self.position).as_dict()

    def _resume(self, root: Path) -> None:
        """Collective: the newest good checkpoint into the script (its `load`) and the session."""
        info = self.info
        if info.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale(root, self.life)
        if self.settings.managed:
            claim_dir(root, self.settings.job_name, info.rank)
            if self.comm.group is not None:
                check_shared(root, self.life, info.rank, info.world_size, self.comm.group)
        assert self.load_fn is not None
        meta = checkpoints.load_newest(root, self.load_fn, self.comm, info.rank)
        if meta is None:
            return
        state = meta["session"]
        self.step_count = self._last_checkpoint = int(meta["step"])
        self.applied_epoch = int(state["control_epoch"])
        given = {int(r): int(b) for r, b in state["batch_sizes"].items()}
        self.split = Split.of(info.world_size, self.settings.training.batch_size, given)
        self.position = Position.from_dict(state["position"])
        self._resumed_groups = state.get("groups")  # entered again at attach(), where the model is
        self._enter_async = self._enter_async or bool(state.get("async", False))
        worlds = f"world {meta['world_size']} -> {info.world_size}"
        reason = f"resumed from the checkpoint of step {self.step_count} ({worlds})"
        self.telemetry.resumed(self.step_count, SyncMode.SYNC, reason)
        self.telemetry.set_control_epoch(self.applied_epoch)
        self.telemetry.set_batch_size(self.split.size(info.rank))
        if self.inbox is not None:
            self.inbox.mark_applied(self.applied_epoch)
        log.info("%s, epoch %d", reason, self.position.epoch)

    def _enter_async_when_ready(self) -> None:
        """Collective, at attach() and at loader(), whichever is last: a checkpoint taken in async resumes
        in it, and a job whose mode is async starts in it."""
        if not self._enter_async or self.exchange is None or self.loader_made is None:
            return
        self._enter_async = False
        why = "resumed in async" if self.step_count > 0 else "the job's mode is async"
        if (obstacle := self.modes.async_obstacle()) is None:
            self.modes.switch(SyncMode.ASYNC, None, why, self.step_count)
        elif self.info.rank == 0:
            log.warning("%s, but async is refused (%s): training in sync", why, obstacle)

    # -- timing -------------------------------------------------------------------------------------
    def _begin(self) -> None:
        if not self._began:
            self._began = True
            self.telemetry.begin_training()

    def _fetching(self) -> None:
        """The loader starts fetching a batch: a step's clock starts there, not at the last step's end
        (what the script does between epochs is no step's compute)."""
        self._begin()
        if self._step_start is None:
            self._step_start = time.perf_counter()
        self.telemetry.computing = True

    def _handed_out(self, size: int, weight: float) -> None:
        self._taken += size
        if self.exchange is not None:
            self.exchange.weight = weight

    def _computed(self) -> None:
        self.telemetry.computing = False

    def _end(self) -> None:
        self.telemetry.finish(self.telemetry.loss)
        report_dir = os.environ.get(ENV_REPORT_DIR)
        if report_dir:
            self.telemetry.write_report(report_dir)
        if self.server is not None:
            self.server.stop()
            self.server = None
