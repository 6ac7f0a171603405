"""How a local run starts its workers, as pure data: the mode, each torchrun agent's command line,
environment and run-config. Ports and the token are chosen by the caller, so this is testable
without starting anything.

One torchrun agent per emulated node (NODE_NAME=local-0, local-1, ...), each with
`nprocPerNode` trainer processes, all joining one c10d rendezvous on 127.0.0.1. Agent 0 hosts the
rendezvous store (`is_host`), so which agent starts first does not matter.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sgdjob_operator.api.models import JobMode, SGDJob
from sgdjob_trainer.config import RunConfig, SyncMode

LOOPBACK = "127.0.0.1"
TRAINER_MODULE = "sgdjob_trainer"


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


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    job: str
    mode: SyncMode
    agents: tuple[AgentPlan, ...]
    rdzv_port: int
    out_dir: Path
    report_dir: Path
    checkpoint_dir: Path | None
    world_size: int
    notes: tuple[str, ...] = ()


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


def run_config(job: SGDJob, mode: SyncMode, *, metrics_port: int, checkpoint_dir: Path | None) -> RunConfig:
    """The trainer's config file for one agent: the spec's training with this run's port and
    checkpoint directory."""
    spec = job.spec
    training = spec.training.model_copy(deep=True)
    training.metrics_port = metrics_port
    if checkpoint_dir is not None:
        training.checkpoint.dir = str(checkpoint_dir)
    return RunConfig(
        job_name=job_name(job),
        mode=mode,
        reference_world_size=spec.min_workers * spec.nproc_per_node,
        training=training,
    )


def torchrun_argv(
    python: str,
    *,
    min_nodes: int,
    max_nodes: int,
    nproc_per_node: int,
    rdzv_port: int,
    rdzv_id: str,
    is_host: bool,
    config_path: Path,
    module: str = TRAINER_MODULE,
    max_restarts: int = 0,
) -> tuple[str, ...]:
    """`python -m torch.distributed.run ... -m sgdjob_trainer --config FILE` for one agent."""
    return (
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={min_nodes}:{max_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={LOOPBACK}:{rdzv_port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={1 if is_host else 0}",
        f"--local-addr={LOOPBACK}",
        # torchrun restarts every worker after a failure (they resume from the newest checkpoint),
        # at most runPolicy.backoffLimit times; membership changes do not count.
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        "--config",
        str(config_path),
    )


def agent_env(base: Mapping[str, str], *, node: str, token: str, report_dir: Path) -> dict[str, str]:
    """The agent's environment (its trainer processes inherit it). The user's own settings for
    threads and the gloo interface are kept."""
    env = dict(base)
    env.update(
        {
            "NODE_NAME": node,
            "SGDJOB_METRICS_HOST": LOOPBACK,
            "SGDJOB_CONTROL_TOKEN": token,
            "SGDJOB_REPORT_DIR": str(report_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("SGDJOB_CONTROL_TOKEN_FILE", None)
    env.pop("SGDJOB_METRICS_PORT", None)  # ports come from each agent's config: metricsPort + LOCAL_RANK
    env.setdefault("OMP_NUM_THREADS", "1")
    # torch 2.13 shares the rendezvous TCP store across rounds, and a restarted worker group then
    # reads the dead group's gloo addresses from it; one store per round avoids that.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all workers are on this machine
    return env


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
) -> LaunchPlan:
    """Everything needed to start the job's `replicas` agents. `metrics_bases[i]` is the first of
    agent i's `nprocPerNode` consecutive free ports."""
    spec = job.spec
    if len(metrics_bases) != spec.replicas:
        raise ValueError(f"need {spec.replicas} metrics port bases, got {len(metrics_bases)}")
    name = job_name(job)
    report_dir = out_dir / "ranks"
    checkpoint_dir = out_dir / "checkpoints" if spec.training.checkpoint.dir is not None else None
    agents = []
    for i, base in enumerate(metrics_bases):
        node = node_name(i)
        config_path = out_dir / f"run-config-{node}.json"
        agents.append(
            AgentPlan(
                index=i,
                node=node,
                argv=torchrun_argv(
                    python,
                    min_nodes=spec.min_workers,
                    max_nodes=spec.max_workers,
                    nproc_per_node=spec.nproc_per_node,
                    rdzv_port=rdzv_port,
                    rdzv_id=name,
                    is_host=i == 0,
                    config_path=config_path,
                    module=trainer_module,
                    max_restarts=spec.run_policy.backoff_limit,
                ),
                env=agent_env(base_env, node=node, token=token, report_dir=report_dir),
                config_path=config_path,
                run_config=run_config(job, mode, metrics_port=base, checkpoint_dir=checkpoint_dir),
                metrics_ports=tuple(range(base, base + spec.nproc_per_node)),
                log_path=out_dir / "logs" / f"{node}.log",
            )
        )
    extra_notes = list(notes)
    if checkpoint_dir is not None:
        extra_notes.append(f"checkpoints go to {checkpoint_dir} (this run's own directory, not spec.training.checkpoint.dir)")
    return LaunchPlan(
        job=name,
        mode=mode,
        agents=tuple(agents),
        rdzv_port=rdzv_port,
        out_dir=out_dir,
        report_dir=report_dir,
        checkpoint_dir=checkpoint_dir,
        world_size=spec.replicas * spec.nproc_per_node,
        notes=tuple(extra_notes),
    )
