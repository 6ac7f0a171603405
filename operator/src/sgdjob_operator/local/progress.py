"""Live progress of a run, as plain data computed from scrapes (pure), plus the plain-text display.

The display is a replaceable piece: anything with the `Display` methods can stand in (the rich
live view of the local-runner issue is one). The runner only calls these four methods.
"""

from __future__ import annotations

import math
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TextIO

from sgdjob_operator.local.report import rank_speed, summary_lines
from sgdjob_operator.policy.eta import Eta, goal, keep_point, keep_validation, predict
from sgdjob_operator.workers.scrape import ScrapeResult
from sgdjob_trainer.config import Target
from sgdjob_trainer.wire.worker_status import WorkerStatus


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One trainer process as last seen; `fresh` is False when this poll got no answer from it."""

    rank: int
    node: str | None
    step: int
    samples: int
    compute_s: float
    wait_s: float
    loss: float | None
    mode: str
    done: bool
    fresh: bool = True
    batch_size: int = 0  # this rank's batch now (0: not said)
    # Rank 0's latest validation on the held-out split (None: none yet, or another rank).
    validation_step: int | None = None
    validation_loss: float | None = None
    validation_accuracy: float | None = None
    validation_metric: float | None = None

    @property
    def speed(self) -> float:
        return rank_speed(self.samples, self.compute_s)


@dataclass(frozen=True, slots=True)
class ProgressFrame:
    """The job at one poll. `samples_per_s` is the rate since the previous poll (None at first)."""

    time: float
    elapsed_s: float
    workers: tuple[WorkerView, ...] = ()
    samples_per_s: float | None = None
    errors: tuple[str, ...] = ()

    @property
    def step(self) -> int:
        return max((w.step for w in self.workers), default=0)

    @property
    def samples(self) -> int:
        return sum(w.samples for w in self.workers)

    @property
    def bound_per_s(self) -> float:
        return sum(w.speed for w in self.workers)

    @property
    def loss(self) -> float | None:
        losses = [w.loss for w in self.workers if w.loss is not None]
        return statistics.fmean(losses) if losses else None

    @property
    def mode(self) -> str:
        modes = sorted({w.mode for w in self.workers if w.fresh and not w.done} or {w.mode for w in self.workers})
        return "/".join(modes) if modes else "starting"

    @property
    def mode_shown(self) -> str:
        """The mode as the displays (and kubectl get) show it: 'sync (rebalanced)' while batches differ."""
        batches = {w.batch_size for w in self.workers if w.fresh and not w.done and w.batch_size > 0}
        return self.mode + (" (rebalanced)" if len(batches) > 1 else "")

    @property
    def reachable(self) -> int:
        return sum(1 for w in self.workers if w.fresh)


def worker_from_status(status: WorkerStatus) -> WorkerView:
    """A WorkerView from a parsed /status document."""
    loss = status.loss
    return WorkerView(
        rank=status.rank,
        node=status.node,
        step=status.step,
        samples=status.samples,
        compute_s=status.compute_seconds,
        wait_s=status.comm_wait_seconds,
        loss=loss if loss is not None and math.isfinite(loss) else None,
        mode=status.mode.value if status.mode is not None else "unknown",
        done=status.done,
        batch_size=status.batch_size,
        validation_step=status.validation_step,
        validation_loss=status.validation_loss,
        validation_accuracy=status.validation_accuracy,
        validation_metric=status.validation_metric,
    )


class EtaTracker:
    """The time left as both displays show it: `policy.eta` over this run's recent polls and rank 0's
    validations of the target's metric (to the last step when the job has no target)."""

    def __init__(self, steps: int, target: Target | None = None) -> None:
        self.steps = steps
        self.target = target
        self.points: list[tuple[float, int]] = []
        self.validations: list[tuple[int, float]] = []

    def reset(self) -> None:
        """A new world: its pace is not the old one's."""
        self.points = []

    def update(self, snap: ProgressFrame) -> Eta | None:
        if snap.step > 0:
            self.points = keep_point(self.points, snap.time, snap.step)
        rank0 = next((w for w in snap.workers if w.rank == 0), None)
        if self.target is not None and rank0 is not None:
            self.validations = keep_validation(
                self.validations,
                self.target,
                rank0.validation_step,
                rank0.validation_loss,
                rank0.validation_accuracy,
                rank0.validation_metric,
            )
        return predict(self.points, self.steps, self.validations, goal(self.target) if self.target else None)


def eta_text(eta: Eta | None) -> str:
    """'4m10s to target', '35s to last step' or '-'."""
    return f"{eta.text} to {eta.basis}" if eta is not None else "-"


def summarize(
    results: Sequence[ScrapeResult], *, now: float, start: float, previous: ProgressFrame | None = None
) -> ProgressFrame:
    """Fold one poll into a ProgressFrame. Workers that did not answer keep their last view (not fresh),
    so totals do not drop while a worker is briefly unreachable or after its server has closed."""
    seen: dict[int, WorkerView] = {w.rank: replace(w, fresh=False) for w in (previous.workers if previous else ())}
    errors: list[str] = []
    for result in results:
        view = worker_from_status(result.status) if result.status is not None else None
        if view is not None:
            seen[view.rank] = view
        elif result.error:
            errors.append(f"{result.endpoint.url}: {result.error}")
    workers = tuple(sorted(seen.values(), key=lambda w: w.rank))
    rate: float | None = None
    if previous is not None and previous.workers and now > previous.time:
        rate = max(0.0, (sum(w.samples for w in workers) - previous.samples) / (now - previous.time))
    return ProgressFrame(time=now, elapsed_s=now - start, workers=workers, samples_per_s=rate, errors=tuple(errors))


def progress_line(snap: ProgressFrame, total_steps: int, expected_workers: int, eta: Eta | None = None) -> str:
    """One plain progress line."""
    loss = f"{snap.loss:.4f}" if snap.loss is not None else "n/a"
    rate = f"{snap.samples_per_s:.1f}" if snap.samples_per_s is not None else "n/a"
    return (
        f"[{snap.elapsed_s:6.1f}s] step {snap.step}/{total_steps}  loss {loss}  "
        f"samples/s {rate} (bound {snap.bound_per_s:.1f})  mode {snap.mode_shown}  "
        f"workers {snap.reachable}/{expected_workers}  ETA {eta_text(eta)}"
    )


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What the display is told at start."""

    job: str
    mode: str
    nodes: int
    workers: int
    steps: int
    out_dir: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    target: Target | None = None  # spec.training.target: the ETA counts to it
    # Command mode (spec.training.command): the user's program, whose own arguments decide how long
    # it trains; training.steps is never passed to it, so the start line names the command instead.
    command: tuple[str, ...] | None = None


def run_length(info: RunInfo) -> str:
    """The start line's last part: what decides how long the run is."""
    return f"command: {shlex.join(info.command)}" if info.command is not None else f"{info.steps} steps"


class Display(Protocol):
    def start(self, info: RunInfo) -> None: ...

    def update(self, snap: ProgressFrame) -> None: ...

    def note(self, text: str) -> None: ...

    def resize(self, nodes: int, workers: int) -> None: ...

    def finish(self, report: Mapping[str, Any] | None, message: str) -> None: ...


class PlainDisplay:
    """Plain lines on a stream, at most one progress line every `every_s` seconds."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 2.0) -> None:
        self.stream = stream or sys.stdout
        self.every_s = every_s
        self._info: RunInfo | None = None
        self._last: float | None = None
        self._last_body = ""
        self._eta = EtaTracker(0)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, info: RunInfo) -> None:
        self._info = info
        self._eta = EtaTracker(info.steps, info.target)
        for line in info.notes:
            self._print(f"note: {line}")
        self._print(
            f"sgdjob run {info.job}: {info.nodes} local node(s), {info.workers} worker process(es), "
            f"mode {info.mode}, {run_length(info)}"
        )
        self._print(f"output: {info.out_dir}")

    def update(self, snap: ProgressFrame) -> None:
        eta = self._eta.update(snap)
        if self._last is not None and snap.time - self._last < self.every_s:
            return
        info = self._info
        line = progress_line(snap, info.steps if info else 0, info.workers if info else len(snap.workers), eta)
        body = line.split("]", 1)[1].rsplit("  ETA ", 1)[0]
        if body == self._last_body:  # nothing moved (e.g. workers finishing): say it once
            return
        self._last, self._last_body = snap.time, body
        self._print(line)

    def note(self, text: str) -> None:
        self._print(text)

    def resize(self, nodes: int, workers: int) -> None:
        if self._info is not None:
            self._info = replace(self._info, nodes=nodes, workers=workers)
        self._eta.reset()

    def finish(self, report: Mapping[str, Any] | None, message: str) -> None:
        if report is not None:
            for line in summary_lines(report):
                self._print(line)
        self._print(message)
