"""What a trainer process reports: Prometheus metrics, the /status document and the end-of-run summary.

Counters are cumulative since the process started (a restart resets them, which is how a scraper
tells one). "samples" counts samples whose gradient reached the model (useful work: a gradient the
parameter server discarded as too stale is not counted); "compute seconds" is time in forward,
backward and optimizer plus emulated compute; "comm wait" is time blocked in collectives or
parameter-server exchanges. Switch pauses and rank 0's validations are counted apart from both.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.gradient_stats import GradientFigures
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.wire import metric_names as wm
from sgdjob_trainer.wire.worker_status import (
    TARGET_REACHED,
    CheckpointReport,
    ResumeRecord,
    SwitchRecord,
    WorkerStatus,
)

# `*_created` series double every counter's output and no consumer here reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The loss history is decimated (every 2nd point dropped, stride doubled) past this many points.
HISTORY_POINTS = 1024


class Telemetry:
    """Thread-safe: the training loop writes, the HTTP server thread reads."""

    def __init__(self, info: WorldInfo, mode: SyncMode, batch_size: int) -> None:
        self.info = info
        self.lock = threading.Lock()
        self.start_time = time.time()
        self.mode = mode
        self.world_size = info.world_size
        self.step = 0
        self.own_steps = 0  # this process's optimizer steps (the metrics' counter; `step` is the job's)
        self.samples = 0
        self.compute_seconds = 0.0
        self.comm_wait_seconds = 0.0
        self.loss = math.nan
        self.staleness = 0.0
        self.batch_size = batch_size
        self.control_epoch = 0
        self.control_error: str | None = None
        self.gradient_bytes = 0
        self.gradient = GradientFigures(0, None, None, None)
        self.switches: list[SwitchRecord] = []
        self.done = False
        self.initial_loss = math.nan
        self.final_loss = math.nan
        self.loss_history: list[tuple[int, float, float]] = []  # (step, loss, seconds since start)
        self._history_stride = 1
        self.mode_timeline: list[dict[str, Any]] = [
            {"timeS": 0.0, "step": 0, "mode": mode.value, "reason": "start mode"}
        ]
        self.end_time: float | None = None
        self._training_since: float | None = None  # monotonic; set by begin_training
        self._last_step_done: float | None = None  # monotonic: when the last step ended (or training began)
        self.computing = False  # inside a step's data, forward, backward and emulated compute
        # Set by recovery: this life's restart count, rank 0's resume history, checkpoint figures.
        self.restart_count: int | None = None
        self.resumes: list[ResumeRecord] | None = None
        self.checkpoint: CheckpointReport | None = None
        # Rank 0's validations: the latest, and (step, loss, accuracy, seconds since start, own samples).
        self.validation: dict[str, Any] = {}
        self.validation_history: list[tuple[int, float, float | None, float, int, float | None]] = []
        # Rank 0 after a restart: when the job's first life began training (wall clock) and the earlier
        # lives' validations, seconds since then (`lineage`), so the job's curve survives its restarts.
        self.job_began: float | None = None
        self.earlier_validations: list[list[Any]] = []

        self.registry = CollectorRegistry()
        r = self.registry
        self.m_steps = Counter(wm.STEPS, "Optimizer steps taken by this process.", registry=r)
        self.m_samples = Counter(wm.SAMPLES, "Samples whose gradient was applied to the model.", registry=r)
        self.m_compute = Counter(
            wm.COMPUTE_SECONDS,
            "Seconds in forward/backward/optimizer plus emulated compute.",
            registry=r,
        )
        self.m_wait = Counter(
            wm.COMM_WAIT_SECONDS,
            "Seconds blocked in collectives or parameter-server exchanges.",
            registry=r,
        )
        self.m_step_time = Histogram(wm.STEP_SECONDS, "Wall seconds per step.", buckets=STEP_BUCKETS, registry=r)
        self.m_loss = Gauge(wm.LOSS, "Training loss of the last step on this process.", registry=r)
        self.m_staleness = Gauge(wm.STALENESS, "Staleness of the last applied update, in steps.", registry=r)
        self.m_world = Gauge(wm.WORLD_SIZE, "Processes in the job.", registry=r)
        self.m_batch = Gauge(wm.BATCH_SIZE, "This process's batch size.", registry=r)
        self.m_epoch = Gauge(wm.CONTROL_EPOCH, "Epoch of the last applied control command.", registry=r)
        self.m_gradient_bytes = Gauge(
            wm.GRADIENT_BYTES,
            "Bytes of this process's gradient in one synchronous exchange.",
            registry=r,
        )
        self.m_gradient = {
            wm.GRADIENT_SQ_NORM: Gauge(
                wm.GRADIENT_SQ_NORM, "Squared norm of the true gradient (estimate).", registry=r
            ),
            wm.GRADIENT_VARIANCE: Gauge(
                wm.GRADIENT_VARIANCE, "Per-sample gradient variance, summed over parameters (estimate).", registry=r
            ),
            wm.GRADIENT_LAG_DOT: Gauge(
                wm.GRADIENT_LAG_DOT, "Dot product of consecutive true gradients (estimate).", registry=r
            ),
        }
        self.m_gradient_steps = Gauge(
            wm.GRADIENT_STAT_STEPS, "Synchronous steps the gradient statistics average over.", registry=r
        )
        self._set_gradient_gauges(self.gradient)
        self.m_mode = Gauge(
            wm.MODE,
            "1 for the active synchronisation mode, 0 for the others.",
            [wm.LABEL_MODE],
            registry=r,
        )
        self.m_training = Gauge(
            wm.TRAINING_SECONDS, "Seconds this process has trained (NaN before training began).", registry=r
        )
        self.m_training.set_function(self.training_seconds)
        self.m_stalled = Gauge(
            wm.STALLED_SECONDS, "Seconds since this process last finished a step (NaN before training).", registry=r
        )
        self.m_stalled.set_function(self.stalled_seconds)
        self.m_computing = Gauge(
            wm.COMPUTING, "1 while inside a step's own compute (data, forward, backward), 0 otherwise.", registry=r
        )
        self.m_computing.set_function(lambda: 1.0 if self.computing else 0.0)
        self.async_capable = True  # see wire.metric_names.ASYNC_CAPABLE
        self.m_async_capable = Gauge(
            wm.ASYNC_CAPABLE, "0 when the optimizer's state cannot be sharded for async mode, else 1.", registry=r
        )
        self.m_async_capable.set_function(lambda: 1.0 if self.async_capable else 0.0)
        self.hierarchical_capable = True  # see wire.metric_names.HIERARCHICAL_CAPABLE
        self.m_hierarchical_capable = Gauge(
            wm.HIERARCHICAL_CAPABLE, "0 when this process cannot run hierarchical mode, else 1.", registry=r
        )
        self.m_hierarchical_capable.set_function(lambda: 1.0 if self.hierarchical_capable else 0.0)
        self.adaptive = False  # see wire.metric_names.ADAPTIVE
        self.m_adaptive = Gauge(
            wm.ADAPTIVE, "1 when the optimizer normalises its steps by the gradients' running RMS, else 0.", registry=r
        )
        self.m_adaptive.set_function(lambda: 1.0 if self.adaptive else 0.0)
        self.m_info = Gauge(wm.WORKER_INFO, "Identity of this process.", list(wm.WORKER_INFO_LABELS), registry=r)
        self.m_switches = Counter(wm.SWITCHES, "Mode switches done.", registry=r)
        self.m_pause = Counter(wm.SWITCH_PAUSE_SECONDS, "Seconds spent paused in mode switches.", registry=r)
        self.m_validation_seconds = Counter(
            wm.VALIDATION_SECONDS, "Seconds spent validating (rank 0), not counted as compute.", registry=r
        )
        self.m_validation_loss = Gauge(wm.VALIDATION_LOSS, "Loss on the held-out split (rank 0).", registry=r)
        self.m_validation_accuracy = Gauge(
            wm.VALIDATION_ACCURACY, "Accuracy on the held-out split (rank 0, classification).", registry=r
        )
        self.m_validation_metric = Gauge(
            wm.VALIDATION_METRIC, "The job's evaluation.metric on the held-out split (rank 0).", registry=r
        )
        identity = {wm.LABEL_RANK: str(info.rank), wm.LABEL_LOCAL_RANK: str(info.local_rank), wm.LABEL_NODE: info.node}
        self.m_info.labels(**identity).set(1)
        self.m_world.set(info.world_size)
        self.m_batch.set(batch_size)
        self._set_mode_gauge(mode)

    def _set_mode_gauge(self, mode: SyncMode) -> None:
        for m in SyncMode:
            self.m_mode.labels(**{wm.LABEL_MODE: m.value}).set(1 if m == mode else 0)

    def begin_training(self) -> None:
        """The training loop starts: every counter is still zero, and counts from now."""
        with self.lock:
            self.start_time = time.time()
            self._training_since = self._last_step_done = time.monotonic()

    def training_seconds(self) -> float:
        """Seconds since `begin_training`, on this process's monotonic clock; NaN before it."""
        since = self._training_since
        return math.nan if since is None else time.monotonic() - since

    def stalled_seconds(self) -> float:
        """Seconds since the last step ended (or training began); NaN before training began. A rank
        that hangs grows it without bound; one that waits for a hung peer too, but not computing."""
        done = self._last_step_done
        return math.nan if done is None else time.monotonic() - done

    def record_step(
        self, step: int, samples: int, compute_s: float, wait_s: float, step_s: float, loss: float, staleness: float
    ) -> None:
        self._last_step_done = time.monotonic()
        with self.lock:
            self.step = step
            self.own_steps += 1
            self.samples += samples
            self.compute_seconds += compute_s
            self.comm_wait_seconds += wait_s
            self.loss = loss
            self.staleness = staleness
            if step % self._history_stride == 0:
                self.loss_history.append((step, loss, time.time() - self.start_time))
                if len(self.loss_history) > HISTORY_POINTS:
                    self.loss_history = self.loss_history[::2]
                    self._history_stride *= 2
        self.m_steps.inc()
        self.m_samples.inc(samples)
        self.m_compute.inc(compute_s)
        self.m_wait.inc(wait_s)
        self.m_step_time.observe(step_s)
        self.m_loss.set(loss)
        self.m_staleness.set(staleness)

    def resumed(self, step: int, mode: SyncMode, reason: str) -> None:
        """A restarted process continues at `step` in `mode` (from a checkpoint)."""
        with self.lock:
            self.step, self.mode = step, mode
            self.mode_timeline = [{"timeS": 0.0, "step": step, "mode": mode.value, "reason": reason}]
        self._set_mode_gauge(mode)

    def set_step(self, step: int) -> None:
        with self.lock:
            self.step = step

    def set_batch_size(self, batch_size: int) -> None:
        with self.lock:
            self.batch_size = batch_size
        self.m_batch.set(batch_size)

    def set_gradient_bytes(self, nbytes: int) -> None:
        with self.lock:
            self.gradient_bytes = nbytes
        self.m_gradient_bytes.set(nbytes)

    def set_gradient_figures(self, figures: GradientFigures) -> None:
        with self.lock:
            if figures == self.gradient:
                return
            self.gradient = figures
        self._set_gradient_gauges(figures)

    def _set_gradient_gauges(self, figures: GradientFigures) -> None:
        values = {
            wm.GRADIENT_SQ_NORM: figures.sq_norm,
            wm.GRADIENT_VARIANCE: figures.variance,
            wm.GRADIENT_LAG_DOT: figures.lag_dot,
        }
        for name, value in values.items():
            self.m_gradient[name].set(math.nan if value is None else value)
        self.m_gradient_steps.set(figures.steps)

    def set_control_epoch(self, epoch: int, error: str | None = None) -> None:
        """The command of `epoch` is applied; `error` says what of it this process refused."""
        with self.lock:
            self.control_epoch = epoch
            self.control_error = error
        self.m_epoch.set(epoch)

    def record_switch(self, from_mode: SyncMode, to_mode: SyncMode, step: int, pause_s: float, reason: str) -> None:
        now = time.time() - self.start_time
        record = SwitchRecord(
            from_mode=from_mode,
            to_mode=to_mode,
            step=step,
            pause_s=pause_s,
            reason=reason,
            time_s=now,
        )
        with self.lock:
            self.mode = to_mode
            self.switches.append(record)
            self.mode_timeline.append({"timeS": now, "step": step, "mode": to_mode.value, "reason": reason})
        self._set_mode_gauge(to_mode)
        self.m_switches.inc()
        self.m_pause.inc(pause_s)

    def record_validation(
        self, step: int, loss: float, accuracy: float | None, seconds: float, metric: float | None = None
    ) -> None:
        with self.lock:
            self.validation.update(validation_loss=_finite(loss), validation_accuracy=accuracy, validation_step=step)
            if metric is not None:
                self.validation.update(validation_metric=_finite(metric))
            point = (step, loss, accuracy, time.time() - self.start_time, self.samples, metric)
            if self.validation_history and self.validation_history[-1][0] == step:
                self.validation_history.pop()  # the final validation at the step of a periodic one
            elif len(self.validation_history) >= HISTORY_POINTS:
                # Keep the first point and every other one after it: the curve thins, its ends stay.
                self.validation_history = self.validation_history[:1] + self.validation_history[2::2]
            self.validation_history.append(point)
        self.m_validation_seconds.inc(seconds)
        if math.isfinite(loss):
            self.m_validation_loss.set(loss)
        if accuracy is not None:
            self.m_validation_accuracy.set(accuracy)
        if metric is not None:
            self.m_validation_metric.set(metric)

    def record_target(self, step: int) -> None:
        """Rank 0's validation reached the job's target at `step` (the job then ends at an agreed step),
        in seconds since the job began training (its first life's start)."""
        with self.lock:
            began = self._began()
            self.validation.update(target_step=step, time_to_target_s=time.time() - began, end_reason=TARGET_REACHED)

    def _began(self) -> float:
        """When the job began training (wall clock): its first life's start. Call under the lock."""
        return self.start_time if self.job_began is None else self.job_began

    def continue_lineage(self, began: float, validations: list[list[Any]]) -> None:
        """A restarted rank 0 carries on the job's history: its first training start and the
        validations of its earlier lives (as `lineage` gave them)."""
        with self.lock:
            self.job_began = began
            self.earlier_validations = [list(v) for v in validations][-HISTORY_POINTS:]

    def lineage(self) -> dict[str, Any]:
        """When the job began training and every validation of its lives so far, seconds since then:
        what a restart's rank 0 continues from (kept beside the checkpoints)."""
        with self.lock:
            began = self._began()
            shift = self.start_time - began
            mine = [
                [s, _finite(v), a, round(t + shift, 3), n, None if m is None else _finite(m)]
                for s, v, a, t, n, m in self.validation_history
            ]
            return {"began": began, "validations": [*self.earlier_validations, *mine]}

    def finish(self, final_loss: float) -> None:
        with self.lock:
            self.final_loss = final_loss
            self.done = True
            self.end_time = time.time()

    def render_metrics(self) -> bytes:
        return generate_latest(self.registry)

    def status(self) -> WorkerStatus:
        with self.lock:
            optional = {
                "control_error": self.control_error,
                "restart_count": self.restart_count,
                "resumes": self.resumes,
                "checkpoint": self.checkpoint,
                **self.validation,
                "stalled_seconds": _finite(self.stalled_seconds()),
                "training_seconds": _finite(self.training_seconds()),
                "gradient_sq_norm": self.gradient.sq_norm,
                "gradient_variance": self.gradient.variance,
                "gradient_lag_dot": self.gradient.lag_dot,
            }
            return WorkerStatus(
                rank=self.info.rank,
                local_rank=self.info.local_rank,
                world_size=self.world_size,
                node=self.info.node,
                mode=self.mode,
                step=self.step,
                own_steps=self.own_steps,
                samples=self.samples,
                compute_seconds=self.compute_seconds,
                comm_wait_seconds=self.comm_wait_seconds,
                loss=_finite(self.loss),
                staleness=self.staleness,
                batch_size=self.batch_size,
                control_epoch=self.control_epoch,
                gradient_bytes=self.gradient_bytes,
                gradient_stat_steps=self.gradient.steps,
                computing=self.computing,
                async_capable=self.async_capable,
                hierarchical_capable=self.hierarchical_capable,
                adaptive_optimizer=self.adaptive,
                switches=list(self.switches),
                done=self.done,
                time=time.time(),
                start_time=self.start_time,
                # Unset fields stay out of the document (exclude_unset), as before they were known.
                **{key: value for key, value in optional.items() if value is not None},
            )

    def summary(self) -> dict[str, Any]:
        """/status plus the run's history: what `sgdjob run` aggregates into report.json."""
        doc = self.status().document()
        with self.lock:
            end = self.end_time or time.time()
            doc.update(
                initialLoss=_finite(self.initial_loss),
                finalLoss=_finite(self.final_loss),
                lossHistory=[[s, _finite(v), round(t, 3)] for s, v, t in self.loss_history],
                jobStartTime=self._began(),
                modeTimeline=list(self.mode_timeline),
                wallSeconds=end - self.start_time,
                speedSamplesPerS=self.samples / self.compute_seconds if self.compute_seconds > 0 else 0.0,
            )
        # Every life's validations, seconds since the job began training (this life's alone before a restart).
        doc["validationHistory"] = self.lineage()["validations"]
        return doc

    def write_report(self, directory: str) -> Path:
        """Write rank-<rank>.json atomically (temp file + rename): a reader never sees half a file."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"rank-{self.info.rank}.json"
        tmp = out / f".rank-{self.info.rank}.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.summary(), indent=1))
        os.replace(tmp, target)
        return target


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
