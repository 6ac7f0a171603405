"""How a controller starts trainers: the run-config file each trainer reads, and the torchrun options
its agent runs with.

The operator writes both into worker pods (the run-config as a ConfigMap, the options as torchrun's
PET_* environment); the local runner writes them into files and agent command lines. Both take
them from here, so a pod and a local agent of the same job start the same trainers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from sgdjob_trainer.config import CamelModel, SyncMode, TrainingConfig

TRAINER_MODULE = "sgdjob_trainer"  # python -m TRAINER_MODULE --config FILE: one trainer process
AGENT_MODULE = "sgdjob_trainer.agent"  # torchrun with forked workers (see sgdjob_trainer.agent)
STORE_MODULE = "sgdjob_trainer.rendezvous_store"  # the c10d store the agents rendezvous through
RDZV_BACKEND = "c10d"
# The rendezvous store's key for the node count the job's controller wants now: a round completes
# as soon as that many agents joined (sgdjob_trainer.rendezvous_rounds); the operator sets it through
# the store pod's health endpoint (PUT STORE_HEALTH_PATH?nodes=N).
INTENDED_NODES_KEY = "sgdjob/intended-nodes"
# Agents the job's controller removed on purpose (a rescale's or a replacement's deleted pod): their
# ids, comma-separated, under DEPARTED_AGENTS_KEY (the operator through PUT ...&departed=ID,ID). Each
# agent writes its rendezvous identity under AGENT_KEY_PREFIX + its id when it starts, so its peers
# take a departed agent off the rendezvous at once instead of waiting for its heartbeats to lapse.
# The id is ENV_AGENT_ID: a pod's UID (never reused, unlike its name or IP), or the local runner's
# name for one launch of an agent.
DEPARTED_AGENTS_KEY = "sgdjob/departed-agents"
AGENT_KEY_PREFIX = "sgdjob/agent/"
ENV_AGENT_ID = "SGDJOB_AGENT_ID"
# The agent's exit status when the rendezvous it joins is already closed: the job ended (its other
# agents finished or gave up) before this node got a world. Not a failure of this node; its peers'
# exit statuses say how the job ended.
EXIT_RENDEZVOUS_CLOSED = 3
# The agent's exit status when its rendezvous timed out: fewer than the job's minimum of nodes
# (--nnodes MIN) joined within the join timeout, so no world formed. Its peers are missing (a lost
# node's pods deleted, replacements not yet scheduled), which is no failure of this node; torchrun
# would exit 1 as for a crash. Peers that crash exit with their own statuses, and those count.
# Not 1 or 2 (torchrun's failure and usage statuses), nor 3 or 127 (the agent's others).
EXIT_RENDEZVOUS_TIMEOUT = 4
# The agent's exit status when training.command's program is not on PATH (a shell's "not found").
EXIT_COMMAND_NOT_FOUND = 127
# Command mode: the script does not report to SGDJob, so nothing that needs its cooperation runs.
COMMAND_MODE_NOTE = "command mode: the script does not report to SGDJob; mode switches and rebalancing are off"
# Command mode with training.adaptation: api: the script reports through sgdjob_trainer.adapt.
ADAPTATION_API_NOTE = (
    "adaptation API: the script reports to SGDJob; per-rank rebalancing, agreed stops and sync <-> "
    "hierarchical switches are on (hierarchical where the script gives adapt.start its optimizer), async off"
)

# The environment a trainer process reads, besides torchrun's own (RANK, WORLD_SIZE, ...).
ENV_NODE_NAME = "NODE_NAME"  # the node it runs on (a pod's spec.nodeName); else the host name
ENV_METRICS_HOST = "SGDJOB_METRICS_HOST"  # the address its HTTP server binds; default 0.0.0.0
ENV_METRICS_PORT = "SGDJOB_METRICS_PORT"  # the server's base port, over training.metricsPort
ENV_CONTROL_TOKEN = "SGDJOB_CONTROL_TOKEN"  # the /control bearer token,
ENV_CONTROL_TOKEN_FILE = "SGDJOB_CONTROL_TOKEN_FILE"  # or a file holding it (re-read per request)
ENV_REPORT_DIR = "SGDJOB_REPORT_DIR"  # where it writes rank-<rank>.json when training ends
# The run-config file, for a command-mode script on the adaptation API (sgdjob_trainer.adapt): the
# trainer gets it as --config; a script finds it here, and without it knows SGDJob did not start it.
ENV_RUN_CONFIG = "SGDJOB_RUN_CONFIG"
# Rank 0 writes how training ended (wire.worker_status.Termination) here: the pod's
# terminationMessagePath, so the operator reads it from the pod's status after the process is gone.
ENV_TERMINATION_LOG = "SGDJOB_TERMINATION_LOG"
# For the agent: torch 2.13 shares the rendezvous round's TCP store with the workers and caches its
# address on non-zero ranks, so after a membership change that moves rank 0 elsewhere survivors dial
# the old rank 0's dead store, and a restarted worker group reads the dead group's gloo addresses.
# Unshared, every round publishes afresh.
ENV_UNSHARED_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class RunConfig(CamelModel):
    """The file a trainer process reads (`--config FILE`): the job's training config plus run facts.

    The operator and the local runner write it from the SGDJob; the trainer imports nothing of theirs.
    """

    job_name: Annotated[
        str,
        Field(max_length=253, description="SGDJob name, for logs and checkpoint paths."),
    ] = "sgdjob"
    mode: Annotated[SyncMode, Field(description="Mode the workers start in.")] = SyncMode.SYNC
    reference_world_size: Annotated[
        int,
        Field(ge=1, le=65_536, description="World size at which learningRate applies unscaled."),
    ] = 1
    training: Annotated[TrainingConfig, Field(description="The SGDJob's spec.training.")] = TrainingConfig()


def run_config(
    job_name: str,
    mode: SyncMode,
    training: TrainingConfig,
    *,
    min_nodes: int,
    nproc_per_node: int,
) -> RunConfig:
    """The run-config of a job whose trainers start in `mode`. The learning rate is the spec's at
    the smallest world the job may run with (minReplicas x nprocPerNode); the trainer scales it
    from there."""
    return RunConfig(job_name=job_name, mode=mode, reference_world_size=min_nodes * nproc_per_node, training=training)


def trainer_args(config_path: str, module: str = TRAINER_MODULE) -> tuple[str, ...]:
    """What an agent runs in each worker process: `-m MODULE --config FILE`."""
    return ("-m", module, "--config", config_path)


def command_args(command: Sequence[str]) -> tuple[str, ...]:
    """What an agent runs in command mode: `--no-python CMD ARGS`, torchrun's own way to exec a
    program (not a Python module) in each worker process, with its environment contract."""
    return ("--no-python", *command)


def restart_budget(backoff_limit: int, max_nodes: int, *, peers_may_leave: bool) -> int:
    """torchrun's --max-restarts for each agent. runPolicy.backoffLimit failures; and where members
    may leave (a lost pod, a replaced or removed worker), one more per possible member: a member
    that leaves ends its peers' round, torchrun counts that against this budget, and the agents must
    not run out of restarts before the job's own limit does."""
    return backoff_limit + (max_nodes if peers_may_leave else 0)


@dataclass(frozen=True, slots=True)
class TorchrunOptions:
    """torchrun's options for one agent. The rendezvous store always runs apart from the agents
    (STORE_MODULE), so every agent joins with is_host=0; `rdzv_conf` adds further settings."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    rdzv_id: str
    max_restarts: int
    local_addr: str | None = None
    rdzv_conf: Mapping[str, int] = field(default_factory=dict)

    def options(self) -> dict[str, str]:
        """Option name (as torchrun spells it on the command line, without `--`) to value."""
        conf = ",".join(["is_host=0", *(f"{key}={value}" for key, value in self.rdzv_conf.items())])
        out = {
            "nnodes": f"{self.min_nodes}:{self.max_nodes}",
            "nproc-per-node": str(self.nproc_per_node),
            "rdzv-backend": RDZV_BACKEND,
            "rdzv-endpoint": self.rdzv_endpoint,
            "rdzv-id": self.rdzv_id,
            "rdzv-conf": conf,
            "max-restarts": str(self.max_restarts),
        }
        if self.local_addr is not None:
            out["local-addr"] = self.local_addr
        return out

    def argv(self) -> tuple[str, ...]:
        """As command-line options: `--nnodes=1:4 ...`."""
        return tuple(f"--{name}={value}" for name, value in self.options().items())

    def env(self) -> dict[str, str]:
        """As torchrun reads them from the environment (PET_<OPTION>), for an unmodified `torchrun`
        command in a user's container."""
        return {option_env(name): value for name, value in self.options().items()}


def option_env(name: str) -> str:
    """The environment variable torchrun reads an option from: `nproc-per-node` -> PET_NPROC_PER_NODE."""
    return "PET_" + name.upper().replace("-", "_")


# The rendezvous store's health endpoint (STORE_MODULE with --health-port): 200 when a round trip
# through the store succeeded just now, else 503 or no answer at all. The operator's per-pass probe
# and the store pod's kubelet probes ask there; a TCP connect cannot tell a hung store from a live one.
STORE_HEALTH_PATH = "/healthz"
