"""Real trainer endpoints for the operator's tests: each worker is the trainer's own `Telemetry` served by
its own `TrainerServer` (rank 0's with its `ControlInbox`, which checks the job's bearer token), on a
loopback address the test reports as its pod's podIP. What the operator reads and pushes is the
trainer's code; only the compute is emulated: a worker's steps advance on the real clock at its speed
(in sync every rank at the slowest rank's pace, the difference spent waiting; in another mode at its
own), and the workers apply a pushed command when the test says they reached a step boundary (`apply`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.server import ControlInbox, TrainerServer
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import ENV_CONTROL_TOKEN

BATCH = 32


class _Worker:
    """One rank: its telemetry and server, and its emulated step clock."""

    def __init__(self, fleet: Fleet, rank: int, host: str, port: int, compute_s: float, node: str) -> None:
        self.fleet, self.rank, self.compute_s = fleet, rank, compute_s
        info = WorldInfo(rank, 0, len(fleet.speeds), 1, rank, 0, node)
        self.telemetry = Telemetry(info, SyncMode.SYNC, BATCH)
        self.telemetry.begin_training()
        self.server = TrainerServer(self.telemetry, fleet.inbox if rank == 0 else None, host, port)
        self._count_reads()
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.done = 0.0
        self.server.start()

    def _count_reads(self) -> None:
        """Every answer first brings the counters up to now; rank 0's /status answers are counted (the
        operator's passes, one read of it each)."""
        base = cast(Any, self.server.httpd.RequestHandlerClass)
        worker = self

        class Counted(base):  # type: ignore[misc,valid-type]
            def do_GET(self) -> None:
                worker.advance()
                if worker.rank == 0 and self.path.split("?", 1)[0] == "/status":
                    worker.fleet.status_reads += 1
                super().do_GET()

        self.server.httpd.RequestHandlerClass = Counted

    def advance(self) -> None:
        with self.lock:
            now = time.monotonic()
            dt, self.last = now - self.last, now
            step_s = max(self.fleet.speeds) if self.fleet.mode is SyncMode.SYNC else self.compute_s
            self.done += dt / step_s
            whole, self.done = int(self.done), self.done - int(self.done)
            for _ in range(whole):
                steps = self.telemetry.own_steps + 1
                self.telemetry.record_step(
                    steps, BATCH, self.compute_s, step_s - self.compute_s, step_s, 1.0 / (1.0 + steps / 100), 0.0
                )


class Fleet:
    """The workers of one job, rank r at `hosts[r]:port` on node `nodes[r]` (default node-r), taking
    `speeds[r]` seconds of compute a step. `offered`: every command the operator pushed that the token
    let through (re-pushes too); `status_reads`: rank 0's /status answers."""

    def __init__(
        self, hosts: Sequence[str], port: int, speeds: Sequence[float], token: str, nodes: Sequence[str] = ()
    ) -> None:
        self.speeds = list(speeds)
        self.mode = SyncMode.SYNC
        self.port = port
        self.inbox = ControlInbox()
        self.offered: list[ControlCommand] = []
        self.status_reads = 0
        offer = self.inbox.offer

        def recorded(command: ControlCommand) -> bool:
            self.offered.append(command)
            return offer(command)

        self.inbox.offer = recorded  # type: ignore[method-assign]
        os.environ[ENV_CONTROL_TOKEN] = token  # what the pod's env gives the trainer, read at each POST
        nodes = list(nodes) or [f"node-{r}" for r in range(len(speeds))]
        self.workers = [_Worker(self, r, hosts[r], port, speeds[r], nodes[r]) for r in range(len(speeds))]

    @property
    def rank0(self) -> Telemetry:
        return self.workers[0].telemetry

    def apply(self) -> ControlCommand | None:
        """Every rank at a step boundary applies rank 0's pending command, as the trainer does."""
        command = self.inbox.take()
        if command is None:
            return None
        for worker in self.workers:
            worker.advance()  # the steps before the switch at the old pace
            t = worker.telemetry
            if command.mode is not None and command.mode != self.mode:
                t.record_switch(self.mode, command.mode, t.own_steps, 0.0, command.reason)
            t.set_control_epoch(command.epoch)
        if command.mode is not None:
            self.mode = command.mode
        return command

    def stop(self) -> None:
        for worker in self.workers:
            worker.server.stop()
