"""What lets a job survive a lost worker: checkpoint triggers, resume at start, the restart
history, emulated faults and the graceful stop on SIGTERM. The Trainer calls in at fixed points.

When checkpoints are taken (every rank must write its part of every checkpoint, or it never
completes): in sync and hierarchical mode every rank passes through the same step numbers, so each
decides alone (`due`, the same on all ranks); in async mode rank 0 decides by its step and asks
the others through shard 0's reply; at the switch barrier (MAX of everyone's newest checkpoint) a
rank that missed a request writes its part, and at the end (and on SIGTERM) one more is written
when `onStop`.

Restart history (rank 0): `progress.json` holds the newest step and time rank 0 reached; a new
life that finds one of another life records {fromStep (the checkpoint loaded), reachedStep,
lostSteps = reachedStep - fromStep, restartSeconds = from that last progress note to the loaded
model}. The progress note is throttled (checkpoint.PROGRESS_EVERY_S, 50 ms), so lostSteps may be
short by the steps of 50 ms and restartSeconds long by as much.

torchrun caveat (torch 2.13): with the rendezvous TCP store shared across rounds (the default),
a restarted worker group finds the previous life's gloo addresses in the store and fails to
connect; agents must run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the local launcher sets it).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from sgdjob_trainer.checkpoint import Checkpointer, Snapshot, claim_dir, read_progress
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.resume import load_latest
from sgdjob_trainer.strategies import StepResult, Strategy
from sgdjob_trainer.wire.status import CheckpointReport, Figures, ResumeRecord

if TYPE_CHECKING:
    from sgdjob_trainer.trainer import Trainer

log = logging.getLogger("sgdjob_trainer.recovery")
EXIT_STOPPED = 143
STUCK_MIN_S = 5.0


class Recovery:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        info, telemetry = trainer.info, trainer.telemetry
        self.history: list[dict[str, Any]] = []
        self.finishing = False  # past the agreed stop: writing the final checkpoint
        self.slowest_step = 0.0
        self._step_at = time.monotonic()
        # One id per start of the job, the same on every rank: names this life's temp directories.
        holder: list[Any] = [uuid.uuid4().hex[:12] if info.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=trainer.ctl)
        self.life = str(holder[0])
        cfg = trainer.training.checkpoint
        if cfg.dir is not None:
            claim_dir(Path(cfg.dir), trainer.config.job_name, info.rank)
        self.ckpt = Checkpointer(cfg, info.rank, self.life) if cfg.dir is not None else None
        telemetry.restart_count = info.restart_count
        if self.ckpt is not None:
            self._resume(self.ckpt)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        else:  # embedded (tests): whoever owns the main thread decides about signals
            log.debug("not on the main thread: no SIGTERM handler")

    def _resume(self, ckpt: Checkpointer) -> None:
        tr = self.trainer
        info, state, telemetry = tr.info, tr.state, tr.telemetry
        previous = None
        if info.rank == 0:
            ckpt.remove_stale()
            previous = read_progress(ckpt.root)
        meta = load_latest(ckpt.root, state, info.rank, info.world_size, tr.ctl)
        if meta is not None:
            ckpt.last = state.step
            reason = f"resumed from the checkpoint of step {state.step} (world {meta['world_size']} -> {info.world_size})"
            telemetry.resumed(state.step, state.mode, reason)
            telemetry.set_control_epoch(state.control_epoch)
            telemetry.set_batch_size(tr.ctx.batch_size())
            if tr.inbox is not None:
                tr.inbox.mark_applied(state.control_epoch)
            log.info("%s, mode %s, lr %.4g", reason, state.mode.value, tr.lr)
        if previous is not None and previous.get("life") != self.life:
            reached = int(previous.get("step", 0))
            record = {
                "fromStep": state.step,
                "reachedStep": reached,
                "lostSteps": max(0, reached - state.step),
                "restartSeconds": round(time.time() - float(previous.get("time", time.time())), 3),
                "worldSize": info.world_size,
                "restartCount": info.restart_count,
            }
            self.history = [*previous.get("resumes", []), record]
            log.info("restart: %d steps lost (reached %d, resumed at %d), %.1f s from the last progress to the loaded model", record["lostSteps"], reached, state.step, record["restartSeconds"])
        if info.rank == 0:
            telemetry.resumes = [ResumeRecord.model_validate(record) for record in self.history]
            ckpt.note_progress(state.step, self.history, force=True)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only flags: the loop stops at an agreed step (the handler runs between bytecodes).
        if not self.trainer.ctx.stopping.is_set():
            self.trainer.ctx.stopping.set()
            threading.Thread(target=self._watchdog, args=(self.trainer.state.step,), name="sgdjob-stop-watchdog", daemon=True).start()

    def _watchdog(self, step: int) -> None:
        """torchrun also sends SIGTERM when a peer died; a rank blocked in a collective with the
        dead peer never reaches the agreed stop, and would hold up the restart until torchrun's
        SIGKILL (30 s). No step within max(5 s, 3 x the slowest step): exit at once."""
        time.sleep(max(STUCK_MIN_S, 3.0 * self.slowest_step))
        if self.trainer.state.step == step and not self.finishing:
            log.warning("SIGTERM: no step completes (a peer is gone?); exiting without a final checkpoint")
            logging.shutdown()
            os._exit(EXIT_STOPPED)

    # -- called by the training loop ------------------------------------------------------------
    def last_checkpoint(self) -> int:
        return self.ckpt.last if self.ckpt is not None else 0

    def after_step(self, strategy: Strategy, result: StepResult) -> None:
        tr = self.trainer
        state, rank = tr.state, tr.info.rank
        now = time.monotonic()
        self.slowest_step, self._step_at = max(self.slowest_step, now - self._step_at), now
        ckpt = self.ckpt
        if ckpt is not None:
            if state.mode == SyncMode.ASYNC and rank != 0:
                if result.checkpoint > ckpt.last:
                    self.take(result.checkpoint, 0)
            elif ckpt.due(state.step):
                self.take(state.step, strategy.checkpoint_weight())
                if state.mode == SyncMode.ASYNC and tr.ctx.ps is not None:
                    tr.ctx.ps.checkpoint_request = state.step
            if rank == 0:
                ckpt.note_progress(state.step, self.history)
        self._faults()

    def at_barrier(self, newest: int) -> None:
        """After the switch barrier: write this rank's part of a checkpoint it has not seen yet."""
        if self.ckpt is not None and self.ckpt.last < newest:
            self.take(newest, 0)

    def at_end(self, interrupted: bool) -> None:
        """Every rank holds the same model here (after leave()); one more checkpoint when asked."""
        tr = self.trainer
        ckpt = self.ckpt
        self.finishing = True
        if ckpt is None:
            return
        if tr.training.checkpoint.on_stop and tr.state.step > ckpt.last:
            self.take(tr.state.step, tr.info.world_size if tr.info.rank == 0 else 0)
        ckpt.flush()
        if tr.info.rank == 0:
            ckpt.note_progress(tr.state.step, self.history, force=True)
        if interrupted:
            log.warning("stopped by SIGTERM at step %d%s", tr.state.step, " after a final checkpoint" if tr.training.checkpoint.on_stop else "")

    def take(self, step: int, weight: int) -> None:
        tr = self.trainer
        state, telemetry, ps = tr.state, tr.telemetry, tr.ctx.ps
        assert self.ckpt is not None

        def snapshot() -> Snapshot:
            shards = ps.snapshot() if ps is not None and state.mode == SyncMode.ASYNC else {}
            meta = None
            if tr.info.rank == 0:
                meta = state.meta_fields() | {"loss": telemetry.loss if math.isfinite(telemetry.loss) else None, "job": tr.config.job_name}
            return Snapshot(
                step=step,
                world_size=tr.info.world_size,
                part=state.rank_part(shards),
                data=state.data.as_dict(),
                model=state.model_part(weight) if weight > 0 else None,
                meta=meta,
            )

        stall = self.ckpt.take(snapshot, step)
        log.debug("checkpoint of step %d queued after a %.1f ms stall", step, stall * 1e3)

    def _faults(self) -> None:
        tr = self.trainer
        info = tr.info
        for fault in tr.training.faults:
            if fault.rank != info.rank or fault.restart != info.restart_count:
                continue
            by_step = fault.at_step is not None and tr.state.step >= fault.at_step
            by_time = fault.after_seconds is not None and time.time() - tr.telemetry.start_time >= fault.after_seconds
            if by_step or by_time:
                log.warning("EMULATED FAULT: rank %d exits abruptly with %d at step %d", info.rank, fault.exit_code, tr.state.step)
                logging.shutdown()
                os._exit(fault.exit_code)

    def report(self) -> None:
        """Checkpoint figures for /status and the rank report."""
        if self.ckpt is not None:
            self.trainer.telemetry.checkpoint = CheckpointReport(
                stall_seconds=Figures.of(self.ckpt.stalls),
                write_seconds=Figures.of(self.ckpt.writes),
                completed=list(self.ckpt.completed),
            )
