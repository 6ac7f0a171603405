"""The training loop: one strategy at a time, switched at agreed points on the controller's command.

Switch protocol (every rank runs the same sequence of collectives, so nothing can deadlock):
1. Rank 0 offers the epoch of its pending control command to each step, read as late as the mode's
   exchange allows; the active mode carries it to every rank (sync: in the gradient allreduce, or,
   while rank 0 waits for a slower rank, in a tiny allreduce right after it; hierarchical: inside the
   cross-group round, consumed at the same step everywhere; async: in the parameter server's reply).
2. A rank that sees an epoch newer than the applied one, or that is done, calls `leave()` on its
   strategy (collective; leaves one consistent model on every rank), then all ranks allreduce
   (done, step) with MAX: the whole job finishes if any rank is done, and every rank continues
   from the same step (the fastest worker's, in async).
3. Rank 0 broadcasts the command it holds (the newest, merged), every rank applies it and the
   next strategy's `enter()` runs. The pause, from leaving the old mode to entering the new one,
   is measured per rank and reported (sgdjob_switch_pause_seconds_total, /status switches).
The same barrier carries (MAX) whether a graceful stop reached the ranks and the newest checkpoint
step, so a rank that has not yet written its part of it (async) writes it there.

Restarts (recovery.py): at start every rank loads the newest good checkpoint (resume.py) and the
loop continues from its step in its mode; checkpoints are taken every `intervalSteps` (checkpoint.py)
and, when `onStop`, at the end and on SIGTERM. SIGTERM: the stop travels with the active mode's
exchange so every rank stops at the same step; the process then exits 143 (not 0), so torchrun
counts a stopped member as a failure and restarts the others from the checkpoint, never as success.

Target (validation.py): when rank 0's validation reaches `training.target`, rank 0 raises the same
stop flag, so every rank stops at one agreed step; the barrier also carries rank 0's "target
reached", which makes that stop a success (exit 0) rather than an interruption.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sgdjob_trainer.assembly import assemble
from sgdjob_trainer.config import Precision, SyncMode, TargetMetric, initial_batches
from sgdjob_trainer.data import DataPosition
from sgdjob_trainer.emulation import ComputeEmulator
from sgdjob_trainer.levers import LossScaler
from sgdjob_trainer.optim import OptimizerTemplate, adaptive, async_obstacle
from sgdjob_trainer.recovery import Recovery
from sgdjob_trainer.runtime import WorldInfo, choose_device, init_distributed, setup_logging, shutdown_distributed
from sgdjob_trainer.server import ControlInbox, TrainerServer, metrics_port
from sgdjob_trainer.strategies import STRATEGIES, Context, Strategy
from sgdjob_trainer.strategies.base import exchange_bytes
from sgdjob_trainer.strategies.hierarchical import valid_groups
from sgdjob_trainer.strategies.ps import ParameterServer
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.train_state import TrainState
from sgdjob_trainer.validation import Validation, Validator, reached
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import (
    ENV_METRICS_HOST,
    ENV_REPORT_DIR,
    ENV_TERMINATION_LOG,
    RunConfig,
)
from sgdjob_trainer.wire.worker_status import Termination

log = logging.getLogger("sgdjob_trainer")


class Trainer:
    def __init__(self, config: RunConfig, info: WorldInfo | None = None) -> None:
        began = time.perf_counter()
        self.config = config
        self.training = t = config.training
        self.info = info or WorldInfo.from_env()
        setup_logging(self.info)
        t.check_world(self.info.world_size)
        self.telemetry = Telemetry(self.info, config.mode, t.batch_size)
        self.inbox = ControlInbox() if self.info.rank == 0 else None
        # The server starts before the process group so a scraper sees the process while it joins.
        host = os.environ.get(ENV_METRICS_HOST, "0.0.0.0")
        self.server = TrainerServer(self.telemetry, self.inbox, host, metrics_port(t, self.info.local_rank))
        self.server.start()
        self.device = choose_device(self.info)
        init_distributed(self.info, self.device)
        joined = time.perf_counter()
        # gloo group for small CPU-side agreements, whatever backend the gradients use.
        self.ctl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

        position = DataPosition()
        parts = assemble(t, self.info, self.device, position, self.ctl)
        assembled = time.perf_counter()
        model, optimizer = parts.model, parts.optimizer
        self.lr_scale = t.lr_scaling.factor(self.info.world_size, config.reference_world_size)
        self.emulator = ComputeEmulator(t.emulation, self.info.rank, self.info.node, t.batch_size, t.seed)
        scaler = LossScaler(t.precision == Precision.FP16)
        self.state = TrainState(
            model=model,
            optimizer=optimizer,
            mode=config.mode,
            groups=t.hierarchical.groups,
            batch_sizes=initial_batches(t, self.info.world_size),
            data=position,
            jitter_rng=self.emulator.rng,
            scaler=scaler,
        )
        # The validation split: no rank trains on it (the stream excludes it), rank 0 validates on it.
        self.stream = parts.stream
        self.eval_x, self.eval_y = parts.eval_x, parts.eval_y
        loss_fn = parts.task.loss
        self.validator = Validator(
            t.evaluation, self.eval_x, self.eval_y, loss_fn, parts.task.is_classification(), parts.task.metric
        )
        if t.target is not None and t.target.metric == TargetMetric.ACCURACY and not self.validator.classification:
            raise ValueError("training.target: an accuracy target needs a classification task (cross-entropy loss)")
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # Whether async mode can shard this optimizer: told to the policy (sgdjob_async_capable).
        self.telemetry.async_capable = async_obstacle(optimizer, self.trainable) is None
        self.telemetry.adaptive = adaptive(optimizer)  # sgdjob_optimizer_adaptive
        self.async_checked = False
        self.target_hit = False  # rank 0: its validation reached training.target
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.telemetry.set_gradient_bytes(exchange_bytes(list(model.parameters()), t.compression))
        ps = ParameterServer(
            self.info.rank,
            self.info.world_size,
            numel,
            t.async_,
            OptimizerTemplate(optimizer, [p for p in model.parameters() if p.requires_grad]),
            t.steps,
            self.inbox.pending_epoch if self.inbox else (lambda: 0),
            self.ctl if self.ctl is not None else dist.group.WORLD,
            parts.schedule,
        )
        # Called on every rank right after each switch (all ranks are at the same point, so an
        # observer may run collectives): lets tests and tools check the model's consistency.
        self.switch_observers: list[Callable[[Trainer], None]] = []
        self.ctx = Context(
            self.info,
            self.device,
            t,
            self.state,
            self.stream,
            self.emulator,
            loss_fn,
            self.lr_scale,
            parts.schedule,
            self.telemetry,
            ps,
            self.ctl,
        )
        self.telemetry.set_batch_size(self.ctx.batch_size())  # a static split's from the start
        if t.rank_batch_sizes is not None and not self.state.batch_sizes and self.info.rank == 0:
            log.warning(
                "training.rankBatchSizes has %d entries but the world has %d ranks: every rank takes batchSize %d",
                len(t.rank_batch_sizes),
                self.info.world_size,
                t.batch_size,
            )
        self.interrupted = False  # the run ended by a graceful stop before its last step
        self.stop_seen = False
        # Checkpoints, resume, emulated faults and SIGTERM; resumes here (collective) when a
        # checkpoint directory holds a good checkpoint.
        self.recovery = Recovery(self.ctx, self.ctl, config.job_name, self.inbox)
        ready = time.perf_counter()
        # Every restart (a rescale, a replacement, a lost node) waits for this set-up on every rank:
        # its parts in the log say where a slow one went.
        log.info(
            "job %s: world %d (restart %d), mode %s at step %d, %s, %s, lr x %.4g, %d steps, device %s; set up in "
            "%.2f s (process group %.2f s, model and data %.2f s, checkpoint and the rest %.2f s)",
            config.job_name,
            self.info.world_size,
            self.info.restart_count,
            self.state.mode.value,
            self.state.step,
            f"task {t.task}" if t.task else f"model {t.model} on {t.dataset}",
            type(optimizer).__name__,
            self.lr_scale,
            t.steps,
            self.device,
            ready - began,
            joined - began,
            assembled - joined,
            ready - assembled,
        )

    def evaluate(self) -> float:
        """Loss of this rank's model on the held-out split."""
        return self.validator.run(self.state.model).loss

    def _validate(self, final: bool = False) -> Validation:
        """Rank 0: one validation into the telemetry; reaching the target (before the final one)
        starts the agreed stop."""
        result = self.validator.run(self.state.model)
        step, target = self.state.step, self.training.target
        self.telemetry.record_validation(step, result.loss, result.accuracy, result.seconds, result.metric)
        if target is not None and not final and not self.target_hit and reached(target, result):
            self.target_hit = True
            self.telemetry.record_target(step)
            # The graceful stop's path: the flag travels with the active mode's exchange, so every
            # rank stops at the same step; the barrier below then ends the run as a success.
            self.ctx.stopping.set()
            log.info("target %s %s reached at step %d", target.metric.value, target.value, step)
        return result

    def _make(self) -> Strategy:
        strategy = STRATEGIES[self.state.mode](self.ctx)
        self.ctx.grad_stats.enter(self.state.mode.value)
        # At once, not after the next step: /status must not pair the new mode with the old figures.
        self.telemetry.set_gradient_figures(self.ctx.grad_stats.figures())
        strategy.enter()
        return strategy

    def train(self) -> TrainState:
        state, t, telemetry = self.state, self.training, self.telemetry
        telemetry.start_time = time.time()  # the validation curve's first point is at 0 s
        telemetry.initial_loss = self._validate().loss if self.info.rank == 0 else self.evaluate()
        telemetry.begin_training()
        strategy = self._make()
        while True:
            done = state.step >= t.steps
            seen = 0
            if not done:
                start = time.perf_counter()
                result = strategy.step(self._offer)
                state.step += 1
                telemetry.record_step(
                    state.step,
                    result.samples,
                    result.compute_s,
                    result.wait_s,
                    time.perf_counter() - start,
                    result.loss,
                    result.staleness,
                )
                telemetry.set_gradient_figures(self.ctx.grad_stats.figures())
                if not self.async_checked and state.mode != SyncMode.ASYNC:
                    # An optimizer SGDJob does not know is judged by its state, which exists now.
                    self.async_checked = True
                    telemetry.async_capable = async_obstacle(state.optimizer, self.trainable) is None
                    telemetry.adaptive = adaptive(state.optimizer)
                if not math.isfinite(result.loss):
                    # Fail loudly (torchrun then stops every worker) rather than train on NaNs.
                    raise FloatingPointError(f"loss is {result.loss} at step {state.step} in {state.mode.value} mode")
                self.recovery.after_step(strategy, result)
                if self.info.rank == 0 and self.validator.due(state.step):
                    self._validate()
                self.stop_seen = self.stop_seen or result.interrupted
                done = result.stop or result.interrupted or state.step >= t.steps
                seen = result.seen_epoch
            if not done and seen <= state.control_epoch:
                continue
            paused = time.perf_counter()
            strategy.leave()
            last = self.recovery.last_checkpoint()
            flags = [int(done), state.step, int(self.stop_seen), last, int(self.target_hit)]
            agreed = torch.tensor(flags, dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.ctl)
            state.step = int(agreed[1])
            telemetry.set_step(state.step)
            self.recovery.at_barrier(int(agreed[3]))
            if int(agreed[0]):
                # A stop that rank 0's reached target started is a success, not an interruption.
                self.interrupted = bool(agreed[2]) and state.step < t.steps and not int(agreed[4])
                self.recovery.at_end(self.interrupted)
                break
            old_mode = state.mode
            command = self._receive_command()
            strategy = self._make()
            pause = time.perf_counter() - paused
            for observer in self.switch_observers:
                observer(self)
            if state.mode != old_mode:
                reason = command.reason if command else ""
                telemetry.record_switch(old_mode, state.mode, state.step, pause, reason)
                log.info(
                    "switched %s -> %s at step %d in %.3f s (epoch %d: %s)",
                    old_mode.value,
                    state.mode.value,
                    state.step,
                    pause,
                    state.control_epoch,
                    reason,
                )
        self._finish()
        return state

    def _offer(self) -> int:
        """The epoch this rank offers to the step's exchange: rank 0's pending command, else 0."""
        return self.inbox.pending_epoch() if self.inbox is not None else 0

    def _receive_command(self) -> ControlCommand | None:
        """Collective: rank 0's newest command to every rank, applied identically everywhere."""
        holder: list[Any] = [None]
        if self.inbox is not None:
            command = self.inbox.take()
            holder[0] = command.model_dump(mode="json", by_alias=True) if command else None
        dist.broadcast_object_list(holder, src=0, group=self.ctl)
        if holder[0] is None:
            return None
        command = ControlCommand.model_validate(holder[0])
        self._apply(command)
        return command

    def _apply(self, command: ControlCommand) -> None:
        state, world = self.state, self.info.world_size
        if command.batch_sizes:
            # A batch must fit in one rank's shard of an epoch (a stream's length is unknown).
            shard = self.stream.size // world if self.stream.size is not None else 65_536
            bad = {r: b for r, b in command.batch_sizes.items() if not 0 <= r < world or not 1 <= b <= shard}
            if bad:
                log.warning(
                    "epoch %d: ignoring batch sizes for unknown ranks or outside 1..%d: %s", command.epoch, shard, bad
                )
            state.batch_sizes.update({r: b for r, b in command.batch_sizes.items() if r not in bad})
        if command.groups is not None:
            if valid_groups(command.groups, world):
                state.groups = [sorted(g) for g in command.groups]
            else:
                log.warning(
                    "epoch %d: groups %s do not cover ranks 0..%d exactly once; keeping %s",
                    command.epoch,
                    command.groups,
                    world - 1,
                    state.groups,
                )
        if command.mode is not None:
            state.mode = command.mode
        state.control_epoch = command.epoch
        if self.inbox is not None:
            self.inbox.mark_applied(command.epoch)
        self.telemetry.set_control_epoch(command.epoch)
        self.telemetry.set_batch_size(self.ctx.batch_size())

    def _write_termination(self, path: Path) -> None:
        status = self.telemetry.status()
        message = Termination(
            step=self.state.step,
            end_reason=status.end_reason,
            target_step=status.target_step,
            time_to_target_s=status.time_to_target_s,
        )
        try:
            path.write_text(json.dumps(message.document(), separators=(",", ":")))
        except OSError as err:  # not in a container, or no such file: the message is a nicety
            log.warning("cannot write the termination message to %s: %s", path, err)

    def _finish(self) -> None:
        final = self._validate(final=True).loss if self.info.rank == 0 else self.evaluate()
        self.recovery.report()
        self.telemetry.finish(final)
        log.info("done at step %d: loss %.5f -> %.5f", self.state.step, self.telemetry.initial_loss, final)
        report_dir = os.environ.get(ENV_REPORT_DIR)
        if report_dir:
            self.telemetry.write_report(report_dir)
        termination_log = os.environ.get(ENV_TERMINATION_LOG)
        if termination_log and self.info.rank == 0:
            self._write_termination(Path(termination_log))
        assert self.ctx.ps is not None
        self.ctx.ps.close()

    def close(self) -> None:
        """Stop serving and leave the process group (after train(), or on an error path)."""
        self.server.stop()
        # After a failure the shard threads may sit in a receive on the group; tearing it down
        # under them can hang, so leave it to process exit (torchrun stops the other workers).
        if self.telemetry.done:
            shutdown_distributed()
