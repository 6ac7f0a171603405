"""How a local run starts its workers, as pure data: the mode, each torchrun agent's command line,
environment and run-config. Ports and the token are chosen by the caller, so this is testable
without starting anything.

One torchrun agent per emulated node (NODE_NAME=local-0, local-1, ...), each with
`nprocPerNode` trainer processes, all joining one c10d rendezvous on 127.0.0.1. The agent is
`sgdjob_trainer.agent`, torchrun with workers forked from it rather than exec'd: on a laptop or a
CI machine the workers' imports of torch were most of a short run's start-up. The rendezvous store
is a process of its own (`python -m sgdjob_trainer.rendezvous_store`, as the operator's store pod), so any
agent, the first included, can be stopped and replaced while the others go on; a replacement gets
the next unused node name (local-N).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sgdjob_operator.api.models import Action, JobMode, SGDJob
from sgdjob_operator.local.command_mode import local_command
from sgdjob_trainer.config import SyncMode, TrainingConfig
from sgdjob_trainer.wire.launch_contract import (
    AGENT_MODULE,
    ENV_AGENT_ID,
    ENV_CONTROL_TOKEN,
    ENV_CONTROL_TOKEN_FILE,
    ENV_METRICS_HOST,
    ENV_METRICS_PORT,
    ENV_NODE_NAME,
    ENV_REPORT_DIR,
    ENV_RUN_CONFIG,
    ENV_UNSHARED_RDZV_STORE,
    STORE_MODULE,
    TRAINER_MODULE,
    RunConfig,
    TorchrunOptions,
    command_args,
    restart_budget,
    run_config,
    trainer_args,
)

LOOPBACK = "127.0.0.1"
# Agents on one machine start within a few seconds of each other, even on 2 loaded cores.
LAST_CALL_S = 5
# last_call: how long a round waits, once min nodes are in, for more to join; torch's 30 s would
# stall every local scale-down for 30 s. A node that left counts as gone after keep_alive_interval x
# keep_alive_max_attempt (torch: 5 s x 3), and the next round waits for that; heartbeats on loopback
# are cheap, so 1 s x 3.
LOCAL_RDZV_CONF = {"last_call_timeout": LAST_CALL_S, "keep_alive_interval": 1, "keep_alive_max_attempt": 3}


@dataclass(frozen=True, slots=True)
class AgentPlan:
    """One torchrun agent: an emulated node with its trainer processes."""

    index: int
    node: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    config_path: Path
    run_config: RunConfig
    metrics_ports: tuple[int, ...]
    log_path: Path
    cwd: Path | None = None  # command mode: the script's working directory (the job file's folder)


@dataclass(frozen=True, slots=True)
class StorePlan:
    """The rendezvous store process every agent joins through."""

    node: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    job: str
    mode: SyncMode
    agents: tuple[AgentPlan, ...]
    store: StorePlan
    world_size: int
    context: LaunchContext  # plans the agents that join later (replacements, scale-up)
    notes: tuple[str, ...] = ()

    @property
    def rdzv_port(self) -> int:
        return self.context.rdzv_port

    @property
    def out_dir(self) -> Path:
        return self.context.out_dir

    @property
    def report_dir(self) -> Path:
        return self.context.report_dir

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.context.checkpoint_dir


def resolve_mode(spec_mode: JobMode, override: str | None) -> tuple[SyncMode, bool]:
    """The mode workers start in, and whether the auto policy drives the run. `--mode` wins over
    spec.mode; auto starts synchronous and lets the policy move it."""
    requested = JobMode(override) if override is not None else spec_mode
    if requested is JobMode.AUTO:
        return SyncMode.SYNC, True
    return SyncMode(requested.value), False


def job_name(job: SGDJob) -> str:
    return str(job.metadata.get("name") or "sgdjob")


def node_name(index: int) -> str:
    return f"local-{index}"


def local_training(job: SGDJob, *, metrics_port: int, checkpoint_dir: Path | None) -> TrainingConfig:
    """The spec's training with this run's port and checkpoint directory."""
    training = job.spec.training.model_copy(deep=True)
    training.metrics_port = metrics_port
    if checkpoint_dir is not None:
        training.checkpoint.dir = str(checkpoint_dir)
    return training


def torchrun_options(job: SGDJob, *, rdzv_port: int, leaving: bool) -> TorchrunOptions:
    """Every agent's torchrun options: the operator's, with the store and agents on loopback. Only
    a run whose policy may replace or remove workers budgets restarts for members that leave. An
    agent that dies meanwhile (a lost node) also costs each survivor one restart; one that runs out
    exits, and the runner counts that as a death and restarts it (`local.revive`, budget backoffLimit).
    The budget is not raised for deaths: an agent whose workers keep failing must exit for the runner
    to judge, not wait in a rendezvous for members that have finished."""
    spec = job.spec
    return TorchrunOptions(
        min_nodes=spec.min_workers,
        max_nodes=spec.max_workers,
        nproc_per_node=spec.nproc_per_node,
        rdzv_endpoint=f"{LOOPBACK}:{rdzv_port}",
        rdzv_id=job_name(job),
        max_restarts=restart_budget(spec.run_policy.backoff_limit, spec.max_workers, peers_may_leave=leaving),
        local_addr=LOOPBACK,
        rdzv_conf=LOCAL_RDZV_CONF,
    )


def agent_argv(
    python: str, options: TorchrunOptions, config_path: Path, module: str, command: Sequence[str] | None = None
) -> tuple[str, ...]:
    """`python -m sgdjob_trainer.agent ... -m sgdjob_trainer --config FILE` for one agent: torchrun's
    options and behaviour, with workers forked from the agent (see sgdjob_trainer.agent). In command
    mode (training.command) the workers exec the user's program instead: `... --no-python CMD args`."""
    if command is not None:
        return (python, "-m", AGENT_MODULE, *options.argv(), *command_args(local_command(command, python)))
    return (python, "-m", AGENT_MODULE, *options.argv(), *trainer_args(str(config_path), module))


def agent_env(
    base: Mapping[str, str], *, node: str, token: str, report_dir: Path, run_config: Path | None = None
) -> dict[str, str]:
    """The agent's environment (its trainer processes inherit it). The user's own settings for
    threads and the gloo interface are kept. `run_config`: the file a script on the adaptation API
    reads (the trainer gets it as --config)."""
    env = dict(base)
    env.update(
        {
            ENV_NODE_NAME: node,
            ENV_METRICS_HOST: LOOPBACK,
            ENV_CONTROL_TOKEN: token,
            ENV_REPORT_DIR: str(report_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop(ENV_RUN_CONFIG, None)  # a run's own, never one inherited from an enclosing run
    if run_config is not None:
        env[ENV_RUN_CONFIG] = str(run_config)
    env.pop(ENV_CONTROL_TOKEN_FILE, None)
    env.pop(ENV_METRICS_PORT, None)  # ports come from each agent's config: metricsPort + LOCAL_RANK
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault(ENV_UNSHARED_RDZV_STORE, "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all workers are on this machine
    return env


@dataclass(frozen=True, slots=True)
class LaunchContext:
    """What every agent of one run shares; `plan_agent` adds the per-agent part (pure)."""

    job: SGDJob
    out_dir: Path
    rdzv_port: int
    token: str
    python: str
    base_env: Mapping[str, str]
    trainer_module: str = TRAINER_MODULE
    membership_changes: bool = False  # whether the run's policy may replace or remove workers
    work_dir: Path | None = None  # where a command-mode script runs (None: the runner's own)
    # The store's health port: the runner tells the store the job's intended size there, so a
    # rendezvous round completes once that many agents joined (sgdjob_trainer.rendezvous_rounds).
    store_health_port: int | None = None

    @property
    def report_dir(self) -> Path:
        return self.out_dir / "ranks"

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.out_dir / "checkpoints" if self.job.spec.training.checkpoint.dir is not None else None

    @property
    def torchrun(self) -> TorchrunOptions:
        return torchrun_options(self.job, rdzv_port=self.rdzv_port, leaving=self.membership_changes)


def may_change_membership(job: SGDJob, auto: bool) -> bool:
    allowed = job.spec.policy.allowed_actions
    return auto and (Action.REPLACE_WORKER in allowed or Action.RESCALE in allowed)


def plan_agent(ctx: LaunchContext, index: int, mode: SyncMode, metrics_base: int) -> AgentPlan:
    """Agent `index` (node local-<index>): its torchrun command, environment and run-config.
    `metrics_base` is the first of its `nprocPerNode` consecutive free ports."""
    spec = ctx.job.spec
    node = node_name(index)
    config_path = ctx.out_dir / f"run-config-{node}.json"
    training = local_training(ctx.job, metrics_port=metrics_base, checkpoint_dir=ctx.checkpoint_dir)
    return AgentPlan(
        index=index,
        node=node,
        argv=agent_argv(ctx.python, ctx.torchrun, config_path, ctx.trainer_module, spec.training.command),
        env={
            **agent_env(ctx.base_env, node=node, token=ctx.token, report_dir=ctx.report_dir, run_config=config_path),
            ENV_AGENT_ID: node,  # the fleet renames a restarted node's agent (`Fleet.start`'s attempt)
        },
        config_path=config_path,
        run_config=run_config(
            job_name(ctx.job),
            mode,
            training,
            min_nodes=spec.min_workers,
            nproc_per_node=spec.nproc_per_node,
        ),
        metrics_ports=tuple(range(metrics_base, metrics_base + spec.nproc_per_node)),
        log_path=ctx.out_dir / "logs" / f"{node}.log",
        cwd=ctx.work_dir if spec.training.command is not None else None,
    )


def write_run_config(agent: AgentPlan) -> None:
    """Write the agent's run-config where its torchrun command line points (`--config`)."""
    agent.config_path.write_text(agent.run_config.model_dump_json(by_alias=True, indent=2) + "\n")


def plan_store(ctx: LaunchContext) -> StorePlan:
    env = dict(ctx.base_env)
    env["PYTHONUNBUFFERED"] = "1"
    argv: tuple[str, ...] = (ctx.python, "-m", STORE_MODULE, "--host", LOOPBACK, "--port", str(ctx.rdzv_port))
    if ctx.store_health_port is not None:
        argv += ("--health-port", str(ctx.store_health_port))
    return StorePlan(node="rendezvous", argv=argv, env=env, log_path=ctx.out_dir / "logs" / "rendezvous.log")


def plan_launch(
    job: SGDJob,
    mode: SyncMode,
    out_dir: Path,
    *,
    rdzv_port: int,
    metrics_bases: Sequence[int],
    token: str,
    python: str,
    base_env: Mapping[str, str],
    notes: Sequence[str] = (),
    trainer_module: str = TRAINER_MODULE,
    auto: bool = False,
    work_dir: Path | None = None,
    store_health_port: int | None = None,
) -> LaunchPlan:
    """Everything needed to start the rendezvous store and the job's `replicas` agents.
    `metrics_bases[i]` is the first of agent i's `nprocPerNode` consecutive free ports."""
    spec = job.spec
    if len(metrics_bases) != spec.replicas:
        raise ValueError(f"need {spec.replicas} metrics port bases, got {len(metrics_bases)}")
    ctx = LaunchContext(
        job,
        out_dir,
        rdzv_port,
        token,
        python,
        base_env,
        trainer_module,
        may_change_membership(job, auto),
        work_dir,
        store_health_port,
    )
    agents = tuple(plan_agent(ctx, i, mode, base) for i, base in enumerate(metrics_bases))
    extra_notes = list(notes)
    if ctx.checkpoint_dir is not None:
        extra_notes.append(
            f"checkpoints go to {ctx.checkpoint_dir} (this run's own directory, not spec.training.checkpoint.dir)"
        )
    return LaunchPlan(
        job=job_name(job),
        mode=mode,
        agents=agents,
        store=plan_store(ctx),
        world_size=spec.replicas * spec.nproc_per_node,
        notes=tuple(extra_notes),
        context=ctx,
    )
