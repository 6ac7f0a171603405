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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sgdjob_trainer.checkpoint import Checkpointer, Snapshot, check_shared, claim_dir, read_progress
from sgdjob_trainer.config import FaultKind, SyncMode
from sgdjob_trainer.resume import load_latest
from sgdjob_trainer.strategies import Context, StepResult, Strategy
from sgdjob_trainer.wire.worker_status import CheckpointReport, Figures, ResumeRecord

if TYPE_CHECKING:
    from sgdjob_trainer.server import ControlInbox

log = logging.getLogger("sgdjob_trainer.recovery")
EXIT_STOPPED = 143
STUCK_MIN_S = 5.0


def start_stop_watchdog(step: Callable[[], int], finishing: Callable[[], bool], slowest_s: Callable[[], float]) -> None:
    """After SIGTERM: torchrun also sends it when a peer died, and a rank blocked in a collective with
    the dead peer never reaches the agreed stop; it would hold up the restart until torchrun's SIGKILL
    (30 s). No step within max(5 s, 3 x the slowest step) and not yet finishing: exit at once."""
    at = step()

    def watch() -> None:
        time.sleep(max(STUCK_MIN_S, 3.0 * slowest_s()))
        if step() == at and not finishing():
            log.warning("SIGTERM: no step completes (a peer is gone?); exiting without a final checkpoint")
            logging.shutdown()
            os._exit(EXIT_STOPPED)

    threading.Thread(target=watch, name="sgdjob-stop-watchdog", daemon=True).start()


class Recovery:
    """Works on the strategies' `ctx` (world, training config, state, telemetry, parameter server, stop
    flag); `ctl` is the group of the small CPU-side agreements (None: the default group), `inbox` rank
    0's control inbox (marked applied up to a resumed checkpoint's epoch)."""

    def __init__(self, ctx: Context, ctl: dist.ProcessGroup | None, job_name: str, inbox: ControlInbox | None) -> None:
        self.ctx, self.ctl, self.job_name, self.inbox = ctx, ctl, job_name, inbox
        info, telemetry = ctx.info, ctx.telemetry
        self.history: list[dict[str, Any]] = []
        self.finishing = False  # past the agreed stop: writing the final checkpoint
        self.slowest_step = 0.0
        self._failures_reported = 0  # checkpoint write failures already in /status
        self._step_at = time.monotonic()
        # One id per start of the job, the same on every rank: names this life's temp directories.
        holder: list[Any] = [uuid.uuid4().hex[:12] if info.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=ctl)
        self.life = str(holder[0])
        # The world's restart count, for faults: on Kubernetes a replacement pod's fresh torchrun agent
        # counts from 0 while its peers count on, so a fault meant for the first life would fire again.
        counts = torch.tensor([info.restart_count], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=ctl)
        self.world_restarts = int(counts.item())
        cfg = ctx.training.checkpoint
        if cfg.dir is not None:
            claim_dir(Path(cfg.dir), job_name, info.rank)
            check_shared(Path(cfg.dir), self.life, info.rank, info.world_size, ctl)
        self.ckpt = Checkpointer(cfg, info.rank, self.life) if cfg.dir is not None else None
        telemetry.restart_count = info.restart_count
        if self.ckpt is not None:
            self._resume(self.ckpt)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        else:  # embedded (tests): whoever owns the main thread decides about signals
            log.debug("not on the main thread: no SIGTERM handler")

    def _resume(self, ckpt: Checkpointer) -> None:
        ctx = self.ctx
        info, state, telemetry = ctx.info, ctx.state, ctx.telemetry
        previous = None
        if info.rank == 0:
            ckpt.remove_stale()
            previous = read_progress(ckpt.root)
        meta = load_latest(ckpt.root, state, info.rank, info.world_size, self.ctl)
        if meta is not None:
            ckpt.last = state.step
            reason = (
                f"resumed from the checkpoint of step {state.step} (world {meta['world_size']} -> {info.world_size})"
            )
            telemetry.resumed(state.step, state.mode, reason)
            telemetry.set_control_epoch(state.control_epoch)
            telemetry.set_batch_size(ctx.batch_size())
            if self.inbox is not None:
                self.inbox.mark_applied(state.control_epoch)
            log.info("%s, mode %s, lr x %.4g", reason, state.mode.value, ctx.lr_scale)
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
            began, validations = previous.get("began"), previous.get("validations")
            if isinstance(began, int | float) and isinstance(validations, list):
                # Validations past the step resumed from are redone by this life.
                kept = [v for v in validations if isinstance(v, list) and v and v[0] <= state.step]
                telemetry.continue_lineage(float(began), kept)
            log.info(
                "restart: %d steps lost (reached %d, resumed at %d), %.1f s from the last progress to the loaded model",
                record["lostSteps"],
                reached,
                state.step,
                record["restartSeconds"],
            )
        if info.rank == 0:
            telemetry.resumes = [ResumeRecord.model_validate(record) for record in self.history]
            ckpt.note_progress(state.step, self.history, force=True, lineage=telemetry.lineage)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only flags: the loop stops at an agreed step (the handler runs between bytecodes).
        if not self.ctx.stopping.is_set():
            self.ctx.stopping.set()
            start_stop_watchdog(lambda: self.ctx.state.step, lambda: self.finishing, lambda: self.slowest_step)

    # -- called by the training loop ------------------------------------------------------------
    def last_checkpoint(self) -> int:
        return self.ckpt.last if self.ckpt is not None else 0

    def after_step(self, strategy: Strategy, result: StepResult) -> None:
        ctx = self.ctx
        state, rank = ctx.state, ctx.info.rank
        now = time.monotonic()
        self.slowest_step, self._step_at = max(self.slowest_step, now - self._step_at), now
        ckpt = self.ckpt
        if ckpt is not None:
            if state.mode == SyncMode.ASYNC and rank != 0:
                if result.checkpoint > ckpt.last:
                    self.take(result.checkpoint, 0)
            elif ckpt.due(state.step):
                self.take(state.step, strategy.checkpoint_weight())
                if state.mode == SyncMode.ASYNC and ctx.ps is not None:
                    ctx.ps.checkpoint_request = state.step
            if rank == 0:
                ckpt.note_progress(state.step, self.history, lineage=ctx.telemetry.lineage)
            if len(ckpt.failures) != self._failures_reported:
                self.report()  # a failed write shows in /status at once, not at the end
        self._faults()

    def at_barrier(self, newest: int) -> None:
        """After the switch barrier: write this rank's part of a checkpoint it has not seen yet."""
        if self.ckpt is not None and self.ckpt.last < newest:
            self.take(newest, 0)

    def at_end(self, interrupted: bool) -> None:
        """Every rank holds the same model here (after leave()); one more checkpoint when asked."""
        ctx = self.ctx
        ckpt = self.ckpt
        self.finishing = True
        if ckpt is None:
            return
        if ctx.training.checkpoint.on_stop and ctx.state.step > ckpt.last:
            self.take(ctx.state.step, ctx.info.world_size if ctx.info.rank == 0 else 0)
        ckpt.flush()
        if ctx.info.rank == 0:
            ckpt.note_progress(ctx.state.step, self.history, force=True, lineage=ctx.telemetry.lineage)
        if interrupted:
            log.warning(
                "stopped by SIGTERM at step %d%s",
                ctx.state.step,
                " after a final checkpoint" if ctx.training.checkpoint.on_stop else "",
            )

    def take(self, step: int, weight: int) -> None:
        ctx = self.ctx
        state, telemetry, ps = ctx.state, ctx.telemetry, ctx.ps
        assert self.ckpt is not None

        def snapshot() -> Snapshot:
            shards = ps.snapshot() if ps is not None and state.mode == SyncMode.ASYNC else {}
            meta = None
            if ctx.info.rank == 0:
                meta = state.meta_fields() | {
                    "loss": telemetry.loss if math.isfinite(telemetry.loss) else None,
                    "job": self.job_name,
                }
            return Snapshot(
                step=step,
                world_size=ctx.info.world_size,
                part=state.rank_part(shards),
                data=state.data.as_dict(),
                model=state.model_part(weight) if weight > 0 else None,
                meta=meta,
            )

        stall = self.ckpt.take(snapshot, step)
        log.debug("checkpoint of step %d queued after a %.1f ms stall", step, stall * 1e3)

    def _faults(self) -> None:
        ctx = self.ctx
        info = ctx.info
        for fault in ctx.training.faults:
            if not fault.fires_in(info.rank, self.world_restarts):
                continue
            by_step = fault.at_step is not None and ctx.state.step >= fault.at_step
            by_time = fault.after_seconds is not None and time.time() - ctx.telemetry.start_time >= fault.after_seconds
            if (by_step or by_time) and fault.kind == FaultKind.HANG:
                log.warning("EMULATED FAULT: rank %d hangs in its compute at step %d", info.rank, ctx.state.step)
                ctx.telemetry.computing = True
                while True:  # until killed: a hung process does not answer SIGTERM's agreed stop either
                    time.sleep(3600)
            if by_step or by_time:
                log.warning(
                    "EMULATED FAULT: rank %d exits abruptly with %d at step %d",
                    info.rank,
                    fault.exit_code,
                    ctx.state.step,
                )
                logging.shutdown()
                os._exit(fault.exit_code)

    def report(self) -> None:
        """Checkpoint figures for /status and the rank report."""
        if self.ckpt is not None:
            failures = list(self.ckpt.failures)
            self._failures_reported = len(failures)
            last = failures[-1] if failures else None
            self.ctx.telemetry.checkpoint = CheckpointReport(
                stall_seconds=Figures.of(self.ckpt.stalls),
                write_seconds=Figures.of(self.ckpt.writes),
                completed=list(self.ckpt.completed),
                failed=len(failures),
                last_error=last[1] if last else None,
                last_error_step=last[0] if last else None,
            )
