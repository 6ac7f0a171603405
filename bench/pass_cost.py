"""The operator's CPU cost of one policy pass of one running job (issue #37: choose the default
`policy.intervalSeconds` from what a pass costs).

    python -m bench.pass_cost --out DIR [--workers 8] [--passes 200] [--sizes 2,8,32] [--slow-factor 2]

For each job size N in `--sizes` (and `--workers`, always measured), a child process serves N
real trainer HTTP servers (`sgdjob_trainer.server.TrainerServer` over `sgdjob_trainer.telemetry.
Telemetry`, the code a worker runs; rank 0's with its control inbox), fed with plausible counters.
This process is the operator side only, and runs what `k8s.reconcile.reconcile` / `_monitor` run
for a running job's policy pass, with the operator's own code, each phase timed in process CPU:

- `scrape`: `k8s.observe.observe` (aiohttp, one session with the operator's connector): every
  worker's /metrics, then rank 0's /status;
- `policy`: `unanswered`/`quiet_reason`, `first_pass_wait`, `in_flight`, `evaluate_job` (the
  driver and the policy core, the policy state round-tripped through its JSON text as it is through
  the job's ConfigMap), `record_observation`, `apply_step`, `command_to_push`, `take_policy_state`;
- `push`: `post_control` to rank 0 when a command is due (most passes: none);
- `status`: `load_status` of the stored status at the start of the pass and `dump_status` plus the
  changed-or-not comparison at its end (every reconcile pass does both).

Not included: the pass's Kubernetes API requests (GET the job and its policy ConfigMap, the cached
pod and node lists, PATCH status and the ConfigMap when they changed: their counts per pass are
reported, `status_changed` and `policy_state_changed`), the store probe, the rest of the reconcile
pass (its plan) and the event loop's scheduling of it. So the capacity figures are an upper bound on
jobs per core.

Time is virtual: pass k sees the job at k policy intervals after training began (the spec's
`policy.intervalSeconds`, default 10 s), and the workers' counters, their `training_seconds` and
`stalled_seconds` advance by exactly one interval between passes, so the policy measures as it does
in a real job while the passes run back to back. The worker model (sync: every rank waits for the
slowest of its group; async: each rank steps alone; rank N-1 `--slow-factor` slower, 5 % jitter)
only makes the counters plausible; the policy's decisions on it are reported (`decisions`), and a command it
pushes is applied by the workers at the next interval, as a trainer applies it at a step boundary.

The trainer side is measured in the child: its process CPU while it only serves (the counters are
advanced outside those windows) per request, and each GET handler's own thread CPU time.

Everything is CPU time (`time.process_time`), which a loaded machine inflates far less than wall
time; wall figures are reported for information only. Writes DIR/pass_cost.json, prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, cast

import aiohttp

import sgdjob_operator
import sgdjob_trainer
from sgdjob_operator.api.models import Phase, SGDJobSpec, SGDJobStatus
from sgdjob_operator.k8s.actuator import apply_step, evaluate_job, first_pass_wait, take_policy_state
from sgdjob_operator.k8s.builders import ROLE_WORKER
from sgdjob_operator.k8s.observe import command_to_push, observe, quiet_reason, record_observation, unanswered
from sgdjob_operator.k8s.reconcile import _pruned
from sgdjob_operator.k8s.status import PodView, controller, dump_status, in_flight, load_status, rfc3339
from sgdjob_operator.workers.scrape import Endpoint, parse_metrics, post_control
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.gradient_stats import GradientFigures
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.server import ControlInbox, TrainerServer
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire.launch_contract import ENV_CONTROL_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZES = (2, 8, 32)
INTERVALS_S = (1.0, 2.0, 5.0, 10.0)
CPU_SHARE = 0.2  # the share of one core the operator may spend on policy passes (the recommendation's rule)
FLEET_JOBS = 100  # jobs the recommendation's rule serves at CPU_SHARE (issue #37: 100 jobs x 8 workers)
WARMUP_PASSES = 3  # not counted: the first passes set up connections and the policy's first windows
# The operator's defaults (k8s.settings.Settings, k8s.handlers.startup).
SCRAPE_TIMEOUT_S = 2.0
SCRAPE_GRACE_S = 120.0
CONNECTION_LIMIT = 256

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


# ---------------------------------------------------------------- worker side (child process)


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


# ---------------------------------------------------------------- operator side (this process)


@dataclass(frozen=True, slots=True)
class PassCost:
    """One pass: CPU seconds per phase, the scrape's wall seconds, and what the pass did."""

    scrape: float
    policy: float
    push: float
    status: float
    scrape_wall: float
    evaluated: bool
    decision: str
    pushed: bool
    errors: int
    status_changed: bool
    policy_state_changed: bool

    @property
    def total(self) -> float:
        return self.scrape + self.policy + self.push + self.status


def job_spec(n: int) -> SGDJobSpec:
    """An auto job of n one-process nodes at the shipping policy defaults; replicas fixed (min =
    max), since this bench has no API server to carry a rescale out."""
    doc = {
        "replicas": n,
        "minReplicas": n,
        "maxReplicas": n,
        "mode": "auto",
        "training": {"batchSize": BATCH, "steps": JOB_STEPS},
    }
    return SGDJobSpec.model_validate(doc)


def job_pods(n: int) -> list[PodView]:
    return [
        PodView(f"job-worker-{r}", f"uid-{r}", ROLE_WORKER, r, "Running", True, "127.0.0.1", f"node-{r}", False)
        for r in range(n)
    ]


class Job:
    """What the operator holds of one running job between passes: its stored status (as the API
    server keeps it after a merge patch), its policy state's ConfigMap text and the scrape table."""

    def __init__(self, n: int, ports: Sequence[int], start: float) -> None:
        self.spec = job_spec(n)
        self.pods = job_pods(n)
        # As k8s.observe.endpoints builds them (pod IP + metricsPort), with the child's ports.
        self.endpoints = [
            Endpoint(f"http://127.0.0.1:{port}", pod=pod.name, node=pod.node)
            for port, pod in zip(ports, self.pods, strict=True)
        ]
        status = SGDJobStatus(phase=Phase.RUNNING, start_time=rfc3339(start), replicas=n, ready_replicas=n)
        self.raw_status: dict[str, Any] = _pruned(dump_status(status))
        self.policy_text: str | None = None
        self.failing_since: dict[str, float] = {}


async def one_pass(job: Job, session: aiohttp.ClientSession, now: float, token: str) -> PassCost:
    """One policy pass of `job` at (virtual) time `now`, as `reconcile` and `_monitor` make it."""
    cpu = time.process_time
    c0 = cpu()
    st = load_status(job.raw_status)
    controller(st).policy_state = job.policy_text
    c1 = cpu()
    w1 = time.perf_counter()
    obs = await observe(job.endpoints, now=now, timeout=SCRAPE_TIMEOUT_S, session=session)
    w2 = time.perf_counter()
    c2 = cpu()
    job.failing_since, _late = unanswered(
        obs.errors,
        job.endpoints,
        job.pods,
        job.failing_since,
        now=now,
        grace_s=SCRAPE_GRACE_S,
        quiet=quiet_reason(st, job.spec, job.pods),
    )
    evaluated, decision, command = False, "", None
    if obs.samples and first_pass_wait(job.spec, st, obs) <= 0:
        busy = in_flight(st, job.spec, job.pods)
        step, _problem = evaluate_job(job.spec, st, obs, now, busy)
        record_observation(st, obs, step.health, job.spec)
        outcome = apply_step(st, step, now, job.spec, job.pods)
        command = command_to_push(st, obs)
        evaluated, decision = True, outcome.applied or ("held" if outcome.held else "keep")
    policy_after = take_policy_state(st)
    c3 = cpu()
    if command is not None and obs.control is not None:
        await post_control(obs.control, command, token, timeout=SCRAPE_TIMEOUT_S, session=session)
    c4 = cpu()
    after = _pruned(dump_status(st))
    status_changed = after != job.raw_status
    c5 = cpu()
    state_changed = policy_after is not None and policy_after != job.policy_text
    job.raw_status = after
    if policy_after is not None:
        job.policy_text = policy_after
    return PassCost(
        scrape=c2 - c1,
        policy=c3 - c2,
        push=c4 - c3,
        status=(c1 - c0) + (c5 - c4),
        scrape_wall=w2 - w1,
        evaluated=evaluated,
        decision=decision,
        pushed=command is not None,
        errors=len(obs.errors),
        status_changed=status_changed,
        policy_state_changed=state_changed,
    )


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and 90th percentile, in milliseconds."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "mean": 1e3 * statistics.fmean(ordered),
        "median": 1e3 * statistics.median(ordered),
        "p90": 1e3 * p90,
    }


async def _passes(
    job: Job, workers: Workers, token: str, start: float, passes: int, warmup: int
) -> tuple[list[PassCost], list[PassCost], str]:
    """The warm-up passes, the measured ones, and rank 0's /metrics text as the last pass saw it."""
    costs: list[PassCost] = []
    interval = job.spec.policy.interval_seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTION_LIMIT)) as session:
        for k in range(warmup + passes):
            if k == warmup:
                workers.ask("reset")
            elapsed = (k + 1) * interval
            workers.ask(f"advance {elapsed!r}")
            costs.append(await one_pass(job, session, start + elapsed, token))
        async with session.get(job.endpoints[0].path("/metrics")) as resp:
            text = await resp.text()
    return costs[:warmup], costs[warmup:], text


def parse_cost(text: str, repeat: int = 200) -> float:
    """CPU seconds `parse_metrics` takes on one /metrics text: the share of the scrape that is
    Prometheus text parsing rather than HTTP."""
    start = time.process_time()
    for _ in range(repeat):
        parse_metrics(text, time=0.0)
    return (time.process_time() - start) / repeat


def measure_size(n: int, passes: int, warmup: int, seed: int, slow_factor: float) -> dict[str, Any]:
    """Passes of one job of n workers: the operator's CPU per phase, the trainer's per request."""
    token = secrets.token_hex(16)
    workers = Workers(n, seed, slow_factor, token)
    try:
        start = time.time()
        job = Job(n, workers.ports, start)
        early, costs, text = asyncio.run(_passes(job, workers, token, start, passes, warmup))
        trainer = workers.ask("report")
    finally:
        workers.close()
    requests: dict[str, int] = trainer["requests"]
    handler_cpu: dict[str, float] = trainer["handler_cpu_s"]
    served = sum(requests.values())
    return {
        "workers": n,
        "passes": len(costs),
        "interval_s": job.spec.policy.interval_seconds,
        "cpu_ms": {
            phase: summary([getattr(c, phase) for c in costs])
            for phase in ("scrape", "policy", "push", "status", "total")
        },
        "scrape_wall_ms": summary([c.scrape_wall for c in costs]),
        "parse_metrics_ms_per_worker": 1e3 * parse_cost(text),
        "evaluated": sum(c.evaluated for c in costs),
        "decisions": tally_decisions(costs),
        "warmup_decisions": tally_decisions(early),
        "pushes": sum(c.pushed for c in costs),
        "scrape_errors": sum(c.errors for c in costs),
        "status_changed": sum(c.status_changed for c in costs),
        "policy_state_changed": sum(c.policy_state_changed for c in costs),
        "final_mode": trainer["mode"],
        "final_batches": trainer["batches"],
        "trainer": {
            "requests": requests,
            "cpu_ms_per_request": 1e3 * trainer["serve_cpu_s"] / served if served else None,
            "handler_cpu_ms": {path: 1e3 * handler_cpu[path] / requests[path] for path in requests},
            "payload_bytes": trainer["payload_bytes"],
        },
        "passes_detail": [asdict(c) for c in costs],
    }


def tally_decisions(costs: Sequence[PassCost]) -> dict[str, int]:
    """Evaluated passes by what they decided (keep, held, or the action applied)."""
    out: dict[str, int] = {}
    for c in costs:
        if c.evaluated:
            out[c.decision] = out.get(c.decision, 0) + 1
    return out


def linear_fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """Least-squares cost = fixed + per_worker * N over the measured sizes (None with fewer than 2)."""
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return {"fixed_ms": my - slope * mx, "per_worker_ms": slope}


def capacity(cost_ms: float, trainer_ms: float | None) -> dict[str, Any]:
    """What a pass of `cost_ms` CPU allows: jobs per operator core at each interval (whole core and
    CPU_SHARE of it), the least interval at which FLEET_JOBS jobs fit in CPU_SHARE of a core, and the
    share of a core each worker spends answering one scrape per interval."""
    return {
        "cpu_ms_per_pass": cost_ms,
        "jobs_per_core": {f"{i:g}": 1e3 * i / cost_ms for i in INTERVALS_S},
        f"jobs_per_core_at_{CPU_SHARE:g}": {f"{i:g}": CPU_SHARE * 1e3 * i / cost_ms for i in INTERVALS_S},
        f"least_interval_s_for_{FLEET_JOBS}_jobs_at_{CPU_SHARE:g}": FLEET_JOBS * cost_ms / 1e3 / CPU_SHARE,
        "trainer_core_share": None if trainer_ms is None else {f"{i:g}": trainer_ms / 1e3 / i for i in INTERVALS_S},
    }


def run(
    out: Path,
    workers: int,
    passes: int,
    sizes: Sequence[int],
    warmup: int,
    seed: int = 0,
    slow_factor: float = SLOW_FACTOR,
) -> dict[str, Any]:
    measured = sorted({*sizes, workers})
    load_start = os.getloadavg()
    results: dict[str, Any] = {}
    for n in measured:
        print(f"measuring {n} workers, {warmup} + {passes} passes ...", flush=True)
        results[str(n)] = measure_size(n, passes, warmup, seed, slow_factor)
    job = results[str(workers)]
    # The trainer answers one /metrics per pass (rank 0 also a /status): its CPU per pass, per worker.
    trainer_ms = job["trainer"]["cpu_ms_per_request"]
    doc = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "settings": {
            "sizes": measured,
            "workers": workers,
            "passes": passes,
            "warmup": warmup,
            "seed": seed,
            "step_compute_s": BATCH / SPEED,
            "slow_factor": slow_factor,
            "cpu_clock": "time.process_time (utime+stime of the process)",
        },
        "sizes": results,
        "fit": linear_fit([(float(n), results[str(n)]["cpu_ms"]["total"]["mean"]) for n in measured]),
        "capacity": capacity(job["cpu_ms"]["total"]["mean"], trainer_ms),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "pass_cost.json").write_text(json.dumps(doc, indent=1))
    print(table(doc))
    return doc


def table(doc: Mapping[str, Any]) -> str:
    rows = [
        "| workers | scrape | policy | push | status | **total** (p90) | scrape wall (median) | trainer per request "
        "(/metrics handler) | decisions |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n, r in doc["sizes"].items():
        cpu, tr = r["cpu_ms"], r["trainer"]
        decided = ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))
        rows.append(
            f"| {n} | {cpu['scrape']['mean']:.2f} | {cpu['policy']['mean']:.2f} | {cpu['push']['mean']:.3f} | "
            f"{cpu['status']['mean']:.2f} | **{cpu['total']['mean']:.2f}** ({cpu['total']['p90']:.2f}) | "
            f"{r['scrape_wall_ms']['median']:.1f} | {tr['cpu_ms_per_request']:.2f} "
            f"({tr['handler_cpu_ms'].get('/metrics', math.nan):.2f}) | {decided} |"
        )
    cap = doc["capacity"]
    workers = doc["settings"]["workers"]
    share = f"jobs_per_core_at_{CPU_SHARE:g}"
    least = cap[f"least_interval_s_for_{FLEET_JOBS}_jobs_at_{CPU_SHARE:g}"]
    lines = [
        "operator CPU ms per pass of one job (mean over passes; process CPU)",
        *rows,
        "",
        f"jobs of {workers} workers per operator core ({cap['cpu_ms_per_pass']:.2f} ms a pass; "
        "the pass's API requests not included):",
        "| interval | whole core | at " + f"{CPU_SHARE:.0%} of a core |",
        "|---:|---:|---:|",
        *(f"| {i} s | {cap['jobs_per_core'][i]:.0f} | {cap[share][i]:.0f} |" for i in cap["jobs_per_core"]),
        f"least interval for {FLEET_JOBS} jobs x {workers} workers at {CPU_SHARE:.0%} of a core: {least:.2f} s",
    ]
    if doc["fit"]:
        lines.append(f"fit: {doc['fit']['fixed_ms']:.2f} ms + {doc['fit']['per_worker_ms']:.3f} ms per worker")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pass_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where pass_cost.json goes")
    parser.add_argument("--workers", type=int, default=8, help="job size the capacity figures are for (measured too)")
    parser.add_argument("--passes", type=int, default=200, help="measured passes per size")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="job sizes measured, comma-separated")
    parser.add_argument("--warmup", type=int, default=WARMUP_PASSES, help="passes before the measured ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-factor", type=float, default=SLOW_FACTOR, help="rank N-1's step time over the others'")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child: serve N workers
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.seed, args.slow_factor, sys.stdin, sys.stdout)
        return 0
    if args.out is None:
        parser.error("--out is required")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.passes < 1 or args.workers < 1 or any(n < 1 for n in sizes) or not args.slow_factor > 0:
        parser.error("--passes, --workers, --sizes and --slow-factor must be positive")
    run(args.out, args.workers, args.passes, sizes, args.warmup, args.seed, args.slow_factor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
