"""The worker side of `bench.pass_cost`, the child process: N real trainer HTTP servers
(`TrainerServer` over `Telemetry`, the code a worker runs) in one process, their counters advanced
on the bench's virtual clock by a plausible worker model (`Fleet`, served by `serve`), and
`Workers`, the parent's handle on that child, driven line by line."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

import sgdjob_operator
import sgdjob_trainer
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.gradient_stats import GradientFigures
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.server import ControlInbox, TrainerServer
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire.launch_contract import ENV_CONTROL_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[1]

# The worker model: a step of 0.25 s compute at batch 32 (a mid-sized model on one accelerator);
# rank N-1 2x slower by default (`--slow-factor`), over the default stragglerThreshold (1.5), so every
# pass runs the straggler path (candidates and cost model), the policy's dearer one (under 1.5x it
# calls the job homogeneous and stops early); gradients of a 25.6M-parameter model in fp32 (ResNet-50).
# The job is long (a million steps, days): no pass is cut short by the job's end being near.
BATCH = 32
SPEED = 128.0  # samples per second of compute of a rank of factor 1
SLOW_FACTOR = 2.0  # rank N-1's step time over the others'
JOB_STEPS = 1_000_000
JITTER = 0.05
SYNC_COMM_S = 0.02  # allreduce per synchronous step
ASYNC_COMM_S = 0.01  # parameter-server exchange per asynchronous step
GRADIENT_BYTES = 25_600_000 * 4
VALIDATE_EVERY = 50  # rank 0's steps between validations
SWITCH_PAUSE_S = 2.0


class VirtualTelemetry(Telemetry):
    """The trainer's Telemetry on the bench's virtual clock: `training_seconds` and
    `stalled_seconds` are what a process would report `now` seconds into training, so the policy
    dates windows as in a real job (on the real clock a whole run lasts a few seconds, and every
    pass would look like a restarted process)."""

    def __init__(self, info: WorldInfo, mode: SyncMode, batch_size: int) -> None:
        self.now = 0.0
        self.last_step_at = 0.0
        super().__init__(info, mode, batch_size)

    def training_seconds(self) -> float:
        return self.now

    def stalled_seconds(self) -> float:
        return self.now - self.last_step_at


class Tally:
    """Requests served and the handlers' own thread CPU seconds, per path (handler threads run concurrently)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: dict[str, int] = {}
        self.cpu_s: dict[str, float] = {}

    def add(self, path: str, cpu_s: float) -> None:
        with self.lock:
            self.count[path] = self.count.get(path, 0) + 1
            self.cpu_s[path] = self.cpu_s.get(path, 0.0) + cpu_s

    def reset(self) -> None:
        with self.lock:
            self.count, self.cpu_s = {}, {}


def instrument(server: TrainerServer, tally: Tally) -> None:
    """Time the server's own handlers (what a trainer runs per request, without the accept, the
    thread and the request parsing: those are in the process figure)."""
    base = cast(Any, server.httpd.RequestHandlerClass)

    class Timed(base):  # type: ignore[misc,valid-type]
        def do_GET(self) -> None:
            start = time.thread_time()
            super().do_GET()
            tally.add(self.path.split("?", 1)[0], time.thread_time() - start)

        def do_POST(self) -> None:
            start = time.thread_time()
            super().do_POST()
            tally.add(self.path.split("?", 1)[0], time.thread_time() - start)

    server.httpd.RequestHandlerClass = Timed


class Fleet:
    """N trainer processes' telemetry and HTTP servers in one process, advanced on a virtual clock."""

    def __init__(self, n: int, seed: int, slow_factor: float) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.inbox = ControlInbox()
        self.mode = SyncMode.SYNC
        self.groups: list[list[int]] = [list(range(n))]
        self.batches = [BATCH] * n
        self.speeds = [SPEED] * (n - 1) + [SPEED / slow_factor]
        self.steps = [0] * n
        self.clock = [0.0] * n  # virtual time each rank's next step starts at
        self.samples_applied = 0
        self.telemetry = [
            VirtualTelemetry(WorldInfo(r, 0, n, 1, r, 0, f"node-{r}"), self.mode, BATCH) for r in range(n)
        ]
        self.servers = [
            TrainerServer(t, self.inbox if r == 0 else None, "127.0.0.1", 0) for r, t in enumerate(self.telemetry)
        ]
        for t in self.telemetry:
            t.begin_training()
            t.set_gradient_bytes(GRADIENT_BYTES)
        for s in self.servers:
            instrument(s, self.tally)
            s.start()

    def apply_control(self, now: float) -> None:
        """Rank 0's pending command, applied by every rank at this boundary (as the trainer does)."""
        command = self.inbox.take()
        if command is None:
            return
        if command.mode is not None and command.mode != self.mode:
            for r, t in enumerate(self.telemetry):
                t.record_switch(self.mode, command.mode, self.steps[r], SWITCH_PAUSE_S, command.reason)
            self.mode = command.mode
            self.clock = [max(c, now) + SWITCH_PAUSE_S for c in self.clock]
        if command.batch_sizes:
            for r, size in command.batch_sizes.items():
                if 0 <= r < self.n:
                    self.batches[r] = size
                    self.telemetry[r].set_batch_size(size)
        if self.mode is SyncMode.ASYNC:
            self.groups = [[r] for r in range(self.n)]
        elif self.mode is SyncMode.HIERARCHICAL and command.groups:
            self.groups = [list(g) for g in command.groups]
        elif self.mode is SyncMode.SYNC:
            self.groups = [list(range(self.n))]
        for t in self.telemetry:
            t.set_control_epoch(command.epoch)

    def advance(self, until: float) -> None:
        """Every group steps until `until` (virtual seconds since training began)."""
        self.apply_control(until)
        for group in self.groups:
            comm = SYNC_COMM_S if len(group) > 1 else ASYNC_COMM_S
            while True:
                start = max(self.clock[r] for r in group)
                costs = {r: self.batches[r] / self.speeds[r] * (1 + self.rng.gauss(0.0, JITTER)) for r in group}
                wall = max(costs.values()) + comm
                if start + wall > until:
                    break
                for r in group:
                    self.step(r, costs[r], start + wall - self.clock[r] - costs[r], wall, start + wall)
        for t in self.telemetry:
            t.now = until
        for r, t in enumerate(self.telemetry):
            # Plausible gradient statistics of a synchronous run (they move slowly).
            if self.mode is not SyncMode.ASYNC and self.steps[r]:
                noise = 1 + self.rng.gauss(0.0, 0.02)
                t.set_gradient_figures(GradientFigures(self.steps[r], 0.8 * noise, 40.0 * noise, 0.6 * noise))

    def step(self, rank: int, compute: float, wait: float, wall: float, end: float) -> None:
        t = self.telemetry[rank]
        self.steps[rank] += 1
        self.samples_applied += self.batches[rank]
        loss = 2.3 * math.exp(-self.samples_applied / 2e5) + 0.05
        staleness = float(self.n - 1) if self.mode is SyncMode.ASYNC else 0.0
        t.now = t.last_step_at = end
        t.record_step(self.steps[rank], self.batches[rank], compute, max(0.0, wait), wall, loss, staleness)
        self.clock[rank] = end
        if rank == 0 and self.steps[0] % VALIDATE_EVERY == 0:
            t.record_validation(self.steps[0], loss * 1.05, min(0.99, 1.0 - loss / 2.5), 0.5)

    def payload_bytes(self) -> dict[str, int]:
        rank0 = self.telemetry[0]
        return {
            "/metrics": len(rank0.render_metrics()),
            "/status": len(json.dumps(rank0.status().model_copy(update={"port": self.servers[0].port}).document())),
        }

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def serve(n: int, seed: int, slow_factor: float, commands: IO[str], replies: IO[str]) -> None:
    """The child's loop: one JSON reply per command line. The process CPU spent between a reply and
    the next command is serving only (the parent scrapes while this loop waits for input)."""
    fleet = Fleet(n, seed, slow_factor)
    serve_cpu = step_cpu = 0.0
    replied_at = time.process_time()

    def reply(doc: Mapping[str, Any]) -> None:
        nonlocal replied_at
        replies.write(json.dumps(doc) + "\n")
        replies.flush()
        replied_at = time.process_time()

    reply({"ports": [s.port for s in fleet.servers]})
    for line in commands:
        got = time.process_time()
        serve_cpu += got - replied_at
        word, _, arg = line.strip().partition(" ")
        if word == "advance":
            fleet.advance(float(arg))
            step_cpu += time.process_time() - got
            reply({"ok": True})
        elif word == "reset":
            serve_cpu = step_cpu = 0.0
            fleet.tally.reset()
            reply({"ok": True})
        elif word == "report":
            with fleet.tally.lock:
                count, cpu = dict(fleet.tally.count), dict(fleet.tally.cpu_s)
            doc = {"serve_cpu_s": serve_cpu, "step_cpu_s": step_cpu, "requests": count, "handler_cpu_s": cpu}
            reply({**doc, "payload_bytes": fleet.payload_bytes(), "mode": fleet.mode.value, "batches": fleet.batches})
        else:
            reply({"error": f"unknown command {word!r}"})
    fleet.stop()


class Workers:
    """The child process, driven line by line."""

    def __init__(self, n: int, seed: int, slow_factor: float, token: str) -> None:
        # The child imports the code this process runs (an editable install may point at another checkout).
        code = [REPO_ROOT, *(Path(str(m.__file__)).parents[1] for m in (sgdjob_operator, sgdjob_trainer))]
        paths = [*map(str, code), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        env = {
            **os.environ,
            ENV_CONTROL_TOKEN: token,
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p)),
        }
        cmd = [
            sys.executable,
            "-m",
            "bench.pass_cost",
            "--serve",
            str(n),
            "--seed",
            str(seed),
            "--slow-factor",
            repr(slow_factor),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ports: list[int] = self._read()["ports"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker process exited ({self.proc.wait()}) without answering")
        doc: dict[str, Any] = json.loads(line)
        if "error" in doc:
            raise RuntimeError(doc["error"])
        return doc

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
