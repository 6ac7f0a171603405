"""The local shell's imperative part: start the agents, poll them through the shared scrape path,
show progress, stop everything on exit, Ctrl-C or SIGTERM, and write `report.json`.

Extension point for the auto mode (issue 8): `run_local(..., on_poll=hook)` calls the hook after
every poll with the `LocalRun` (which can `push` ControlCommands to the control rank), the latest
scrape results (with `WorkerSample`s for the policy) and the progress snapshot. A hook can add
entries to `run.report_extra` (e.g. `decisions`), which end up in report.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from sgdjob_operator.api.models import SGDJob
from sgdjob_operator.local.auto import AutoController
from sgdjob_operator.local.command_mode import run_note
from sgdjob_operator.local.cpulimit import describe, limits_for
from sgdjob_operator.local.deaths import RestartPolicy
from sgdjob_operator.local.fleet import Fleet, MembershipChange, plan_replace, plan_rescale
from sgdjob_operator.local.launch import (
    LOOPBACK,
    AgentPlan,
    LaunchPlan,
    job_name,
    plan_launch,
    resolve_mode,
    write_run_config,
)
from sgdjob_operator.local.procs import ProcessSet, free_port_blocks
from sgdjob_operator.local.progress import Display, ProgressFrame, RunInfo, summarize
from sgdjob_operator.local.report import RANK_FILE_GLOB, build_report, load_rank_docs, with_status_fallback
from sgdjob_operator.local.revive import Reviver
from sgdjob_operator.local.timeline import Timeline
from sgdjob_operator.workers.scrape import ControlResult, Endpoint, ScrapeResult, post_control, scrape
from sgdjob_operator.workers.store_probe import store_answers
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import COMMAND_MODE_NOTE, TRAINER_MODULE
from sgdjob_trainer.wire.worker_status import TARGET_REACHED, WorkerStatus

EXIT_FAILED = 1
EXIT_TIMEOUT = 124
# An agent still running this long after another finished the job waits for a world that will not
# form again (it came back, from a restart, after the others' last round): it is stopped, not failed.
FINISH_GRACE_S = 30.0
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


@dataclass(frozen=True, slots=True)
class RunOptions:
    out_dir: Path
    mode: str | None = None
    poll_interval_s: float = 1.0
    scrape_timeout_s: float = 2.0
    timeout_s: float | None = None
    failure_grace_s: float = 10.0
    # Agents that die are restarted after 1 s, 2 s, 4 s ... (capped); a node whose agent dies
    # crash_loop_deaths times within crash_loop_window_s is replaced under a new name (local.deaths).
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    crash_loop_deaths: int = 3
    crash_loop_window_s: float = 120.0
    stop_grace_s: float = 10.0
    python: str = sys.executable
    trainer_module: str = TRAINER_MODULE  # what torchrun runs with `-m`; the real trainer unless a test swaps it
    # Folders put first on the workers' PYTHONPATH: `sgdjob run` adds the job file's folder, so a
    # task or hook module beside the job file imports as it would from the worker image.
    code_dirs: tuple[Path, ...] = ()
    # Command mode (training.command): the folder the script runs in; `sgdjob run` gives the job
    # file's folder, as the pod template's workingDir would be on a cluster. None: the current one.
    work_dir: Path | None = None


@dataclass(slots=True)
class RunOutcome:
    exit_code: int
    message: str
    report: dict[str, Any] | None
    report_path: Path | None


@dataclass(slots=True)
class LocalRun:
    """A running job, as seen by a poll hook."""

    plan: LaunchPlan
    token: str
    session: aiohttp.ClientSession
    fleet: Fleet
    reviver: Reviver
    started: float = field(default_factory=time.monotonic)
    last_results: list[ScrapeResult] = field(default_factory=list)
    timeline: Timeline = field(default_factory=Timeline)
    last_status: dict[int, WorkerStatus] = field(default_factory=dict)  # by rank, for a report after a stop
    membership_changes: int = 0
    report_extra: dict[str, Any] = field(default_factory=dict)
    next_poll_s: float | None = None  # a hook asked for the next poll sooner than the run's interval

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.fleet.endpoints()

    def poll_within(self, seconds: float) -> None:
        """Poll again after `seconds` at the latest (once; then the run's interval again)."""
        self.next_poll_s = seconds if self.next_poll_s is None else min(self.next_poll_s, seconds)

    async def replace(self, node: str, mode: SyncMode, reason: str) -> None:
        """Stop the agent of `node` and start a new one (a new node name) in its place."""
        change = plan_replace(self.fleet.nodes(), node, self.fleet.next_index)
        await self._change(change, mode, "replaceWorker", reason)

    async def rescale(self, nodes: int, mode: SyncMode, reason: str, remove: tuple[str, ...] = ()) -> None:
        """Run `nodes` agents: the nodes in `remove` leave first, then the newest; or new ones join."""
        change = plan_rescale(self.fleet.nodes(), nodes, remove, self.fleet.next_index)
        await self._change(change, mode, "rescale", reason)

    async def _change(self, change: MembershipChange, mode: SyncMode, action: str, reason: str) -> None:
        await self.fleet.apply(change, mode, action=action, reason=reason, elapsed_s=time.monotonic() - self.started)
        world = self.fleet.world_size()
        # Ranks are handed out anew by the next rendezvous round: what was seen per rank is stale.
        self.last_results = []
        self.last_status = {r: s for r, s in self.last_status.items() if r < world}
        self.membership_changes += 1

    def world_changed(self) -> None:
        """An agent died or came back: ranks are handed out anew by the next rendezvous round."""
        self.last_results = []
        self.membership_changes += 1

    def mode(self) -> SyncMode:
        """The mode the workers last reported (the one a restarted agent starts in)."""
        status = self.last_status.get(0)
        return status.mode if status is not None and status.mode is not None else self.plan.mode

    def control_endpoint(self) -> Endpoint | None:
        """The endpoint of rank 0 (which owns /control), once a scrape has seen it."""
        for result in self.last_results:
            if result.status is not None and result.status.rank == 0:
                return result.endpoint
            if result.sample is not None and result.sample.rank == 0:
                return result.endpoint
        return None

    async def push(self, command: ControlCommand) -> ControlResult:
        endpoint = self.control_endpoint()
        if endpoint is None:
            return ControlResult(0, error="rank 0 has not been seen yet")
        return await post_control(endpoint, command, self.token, session=self.session)


PollHook = Callable[[LocalRun, list[ScrapeResult], ProgressFrame], Awaitable[None]]


def with_code_dirs(env: Mapping[str, str], dirs: Sequence[Path]) -> dict[str, str]:
    """`env` with `dirs` first on PYTHONPATH (after nothing; before what the user had)."""
    out = dict(env)
    paths = [str(d.resolve()) for d in dirs] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return out


def default_out_dir(job: SGDJob, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs") / f"{job_name(job)}-{stamp}"


def restart_policy(job: SGDJob, options: RunOptions) -> RestartPolicy:
    return RestartPolicy(
        backoff_limit=job.spec.run_policy.backoff_limit,
        min_nodes=job.spec.min_workers,
        backoff_s=options.restart_backoff_s,
        max_backoff_s=options.max_restart_backoff_s,
        crash_loop_deaths=options.crash_loop_deaths,
        crash_loop_window_s=options.crash_loop_window_s,
    )


def run_mode(job: SGDJob, options: RunOptions) -> tuple[SyncMode, bool]:
    """resolve_mode, but a command-mode script that does not report cannot be driven: never auto."""
    mode, auto = resolve_mode(job.spec.mode, options.mode)
    return mode, auto and job.spec.training.reports


def prepare(job: SGDJob, options: RunOptions) -> tuple[LaunchPlan, str]:
    """Choose ports and token, create the output directory and write each agent's run-config."""
    mode, auto = run_mode(job, options)
    work_dir = (options.work_dir or Path.cwd()).resolve()
    training = job.spec.training
    notes = (run_note(work_dir, training.on_adaptation_api),) if training.command is not None else ()
    ports = free_port_blocks(job.spec.replicas + 2, job.spec.nproc_per_node)
    token = secrets.token_urlsafe(32)
    out_dir = options.out_dir.resolve()
    plan = plan_launch(
        job,
        mode,
        out_dir,
        rdzv_port=ports[0],
        store_health_port=ports[1],
        metrics_bases=ports[2:],
        token=token,
        python=options.python,
        base_env=with_code_dirs(os.environ, options.code_dirs),
        notes=notes,
        trainer_module=options.trainer_module,
        auto=auto,
        work_dir=work_dir,
    )
    plan.report_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*plan.report_dir.glob(RANK_FILE_GLOB), plan.out_dir / "report.json"]:
        stale.unlink(missing_ok=True)  # an --out reused from an earlier run
    for agent in plan.agents:
        write_run_config(agent)
    return plan, token


def _failure_message(procs: ProcessSet[AgentPlan], plan: LaunchPlan, stopped: set[str]) -> str:
    """Which agents failed (with their log's tail) first, then those the runner had to stop."""
    failed, ended = [], []
    for agent in procs.agents:
        if agent.retired:
            continue
        rc = agent.returncode
        if agent.plan.node in stopped:
            ended.append(f"agent {agent.plan.node} was still running and was stopped by the runner (exit code {rc})")
        elif rc not in (0, None):
            failed.append(f"agent {agent.plan.node} exited with code {rc}; log: {agent.plan.log_path}")
            tail = agent.log_tail()
            if tail:
                failed.append("  " + tail.replace("\n", "\n  "))
    return "\n".join(failed + ended) or f"agents failed; logs in {plan.out_dir / 'logs'}"


async def _supervise(
    run: LocalRun,
    procs: ProcessSet[AgentPlan],
    options: RunOptions,
    display: Display,
    on_poll: PollHook | None,
    stop: asyncio.Event,
    start: float,
    start_wall: float,
) -> str | None:
    """Poll until every agent has exited, a stop is asked for, or the run times out. Returns why it
    stopped early (None when the agents all exited by themselves)."""
    snapshot: ProgressFrame | None = None
    failed_at: float | None = None
    finished_at: float | None = None
    changes = run.membership_changes
    while True:
        procs.track()
        await run.reviver.check(run, run.mode())
        now = time.monotonic()
        if not procs.running() and not run.reviver.pending and not run.reviver.awaiting(run.fleet):
            return None
        if stop.is_set():
            return "stop"
        # A death the reviver does not recover from: the budget is spent, or the job was finishing.
        failed = run.reviver.failure or (
            run.reviver.finishing(run.fleet) and any(a.returncode not in (0, None) for a in run.fleet.active())
        )
        if failed_at is None and failed:
            failed_at = now
            display.note(
                f"an agent failed; stopping the others if they do not exit within {options.failure_grace_s:.0f}s"
            )
        if failed_at is not None and now - failed_at > options.failure_grace_s:
            return "failure"
        if finished_at is None and run.reviver.finishing(run.fleet):
            finished_at = now
        if failed_at is None and finished_at is not None and now - finished_at > FINISH_GRACE_S:
            for agent in procs.running():
                agent.retired = True  # stopped with the rest in run_local's cleanup
                display.note(f"agent {agent.plan.node} has no world to join after the job finished; stopping it")
        if options.timeout_s is not None and now - start > options.timeout_s:
            return "timeout"
        await run.fleet.tell()  # level-based: a store restarted since hears it again
        results = await scrape(run.endpoints, status=True, timeout=options.scrape_timeout_s, session=run.session)
        run.last_results = results
        for result in results:
            if result.status is not None:
                run.last_status[result.status.rank] = result.status
        snapshot = summarize(results, now=time.time(), start=start_wall, previous=snapshot)
        if snapshot.workers:
            display.update(snapshot)
            run.timeline.add(snapshot)
        if on_poll is not None:
            await on_poll(run, results, snapshot)
        if run.membership_changes != changes:  # ranks are handed out anew: forget the old world's view
            changes, snapshot = run.membership_changes, None
        pause = options.poll_interval_s if run.next_poll_s is None else min(options.poll_interval_s, run.next_poll_s)
        run.next_poll_s = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=pause)


def _write_report(
    plan: LaunchPlan,
    job: SGDJob,
    extra: Mapping[str, Any],
    statuses: Mapping[int, WorkerStatus],
    fallback_wall: float,
    world_size: int,
) -> tuple[dict[str, Any], Path]:
    rank_docs, problems = load_rank_docs(plan.report_dir)
    docs = [d for d in with_status_fallback(rank_docs, statuses) if int(d.get("rank", -1)) < world_size]
    emulation = job.spec.training.emulation
    report = build_report(
        docs,
        job=plan.job,
        mode=plan.mode.value,
        expected_workers=world_size,
        emulation=emulation.model_dump(mode="json", by_alias=True) if emulation is not None else None,
        fallback_wall_s=fallback_wall,
        extra={**extra, "rank_file_problems": problems} if problems else extra,
    )
    path = plan.out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report, path


def poll_seconds(requested: float, job: SGDJob, auto: bool) -> float:
    """Seconds between polls: the policy evaluates at a poll, so an auto run polls at least once per
    policy.intervalSeconds (a 0.5-s interval polled every second would see 1-s windows)."""
    return min(requested, job.spec.policy.interval_seconds) if auto else requested


class CleanUp:
    """Clean-up steps that each run even after an earlier one raised. The first error surfaces once
    all have run: raised by `done`, or, when the run is already ending with an error (which came
    first), added to that error as a note rather than hiding it."""

    def __init__(self) -> None:
        self.first: BaseException | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        try:
            yield
        except BaseException as err:  # a cancelled stop too: the next steps must still run
            if self.first is None:
                self.first = err

    def done(self, ending: BaseException | None) -> None:
        if self.first is None or self.first is ending:
            return
        if ending is None:
            raise self.first
        ending.add_note(f"and cleaning up after it failed too: {self.first!r}")


def _mode_label(job: SGDJob, mode: SyncMode) -> str:
    if job.spec.training.on_adaptation_api:
        return f"{mode.value} (your script, on the adaptation API)"
    return "command (your script's own DDP)" if job.spec.training.command is not None else mode.value


async def run_local(job: SGDJob, options: RunOptions, display: Display, on_poll: PollHook | None = None) -> RunOutcome:
    """Run the job's workers on this machine until they finish; always leaves no process behind.
    When the mode is auto and no hook is given, the policy core drives the run (`local.auto`)."""
    plan, token = prepare(job, options)
    emulation = job.spec.training.emulation
    cpu = limits_for(plan.job, emulation.cpu_limits if emulation is not None else None)  # CpuLimitError: the fix
    auto = run_mode(job, options)[1]
    if on_poll is None and auto:
        on_poll = AutoController(job, display)
    options = replace(options, poll_interval_s=poll_seconds(options.poll_interval_s, job, auto))
    display.start(
        RunInfo(
            job=plan.job,
            mode=f"auto (starts {plan.mode.value})" if auto else _mode_label(job, plan.mode),
            nodes=len(plan.agents),
            workers=plan.world_size,
            steps=job.spec.training.steps,
            out_dir=str(plan.out_dir),
            notes=plan.notes + (tuple(describe(cpu.limits, cpu.hierarchy.version)) if cpu is not None else ()),
            target=job.spec.training.target,
            command=tuple(command) if (command := job.spec.training.command) is not None else None,
        )
    )
    stop = asyncio.Event()
    received: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():  # a second Ctrl-C: no more grace
            procs.hurry.set()
        received.append(sig)
        stop.set()

    procs: ProcessSet[AgentPlan] = ProcessSet()
    if cpu is not None:
        procs.cgroups = {node: path for node in cpu.limits if (path := cpu.procs_file(node)) is not None}
    fleet = Fleet(plan, procs, retire_grace_s=options.stop_grace_s)
    reviver = Reviver(restart_policy(job, options), display, plan.checkpoint_dir)
    for sig in SIGNAL_EXIT:
        loop.add_signal_handler(sig, on_signal, sig)
    start, start_wall = time.monotonic(), time.time()
    why: str | None = "stop"
    extra: dict[str, Any] = {}
    statuses: dict[int, WorkerStatus] = {}
    try:
        procs.start_service(plan.store)
        procs.start(plan.agents)
        async with aiohttp.ClientSession() as session:
            run = LocalRun(plan, token, session, fleet, reviver, started=start)
            if plan.context.store_health_port is not None:
                fleet.tell_store = partial(store_answers, session, LOOPBACK, plan.context.store_health_port)
            why = await _supervise(run, procs, options, display, on_poll, stop, start, start_wall)
            extra, statuses = {**run.report_extra, "timeline": run.timeline.to_dict()}, run.last_status
    finally:
        # Each step is guarded: a display that cannot print (a closed pipe) must not leave the
        # workers running, nor a stop that fails leave the CPU-limit cgroups behind.
        clean = CleanUp()
        stopped: set[str] = set()
        with clean.step():
            stopped = {a.plan.node for a in procs.running()}
            if stopped or procs.alive():
                display.note("stopping all worker processes ...")
        with clean.step():
            await loop.run_in_executor(None, procs.stop, options.stop_grace_s)
        if cpu is not None:
            with clean.step():
                left_behind = cpu.remove()  # after the stop: a group still holding a process cannot go
                extra["cpu_limits"] = {**cpu.report(), "left_behind": left_behind}
        for sig in SIGNAL_EXIT:
            with clean.step():
                loop.remove_signal_handler(sig)
        clean.done(sys.exc_info()[1])  # in a finally: what the try block is raising, if anything
    codes = {a.plan.node: a.returncode for a in procs.agents if not a.retired}
    run_wall = time.monotonic() - start
    extra.update({"exit_codes": codes, "run_wall_s": run_wall, "out_dir": str(plan.out_dir)})
    if reviver.records or reviver.store_records:
        extra.update(reviver.report())
    if fleet.history:
        extra["membership"] = fleet.history
        extra["retired_exit_codes"] = {a.plan.node: a.returncode for a in procs.agents if a.retired}
    if plan.checkpoint_dir is not None:
        extra["checkpoint_dir"] = str(plan.checkpoint_dir)
    if why == "stop":
        sig = received[0] if received else signal.SIGTERM
        code, message = SIGNAL_EXIT[sig], f"stopped by {sig.name}: every worker process was ended"
    elif why == "timeout":
        code, message = EXIT_TIMEOUT, f"timed out after {options.timeout_s:.0f}s: every worker process was ended"
    elif all(rc == 0 for rc in codes.values()):
        code, message = 0, "all workers finished"
    else:
        cause = f"{reviver.failure}\n" if reviver.failure else ""
        code, message = EXIT_FAILED, "the job failed:\n" + cause + _failure_message(procs, plan, stopped)
    extra["ok"] = code == 0
    if code != 0:
        extra["error"] = message
    silent = not job.spec.training.reports
    if silent:  # the script reports nothing: no rank is missing, and no training figures to show
        extra["command_mode"] = COMMAND_MODE_NOTE
    report, path = _write_report(plan, job, extra, statuses, run_wall, 0 if silent else fleet.world_size())
    if code == 0 and report.get("reason") == TARGET_REACHED:
        message = f"the validation reached the target at step {report.get('target_step')}: {message}"
    script = job.spec.training.command is not None
    message += f"\nreport: {path}" + (f"\nthe script's output: {plan.out_dir / 'logs'}" if script else "")
    display.finish(None if silent else report, message)
    return RunOutcome(code, message, report, path)
