"""`python -m sgdjob_trainer.agent [torchrun options] -m MODULE [args]`: torchrun whose workers are
forked from an agent that has already imported torch and the trainer.

Same options, rendezvous, restarts and exit status as `torchrun`; the only difference is how a
worker process starts. torchrun execs a fresh interpreter per worker, and each one imports torch
and, at its first optimizer, torch's compiler stack (about 6 s of CPU together); here the agent
pays that once, before any rendezvous, and every worker of every restart is a fork of it that runs
MODULE as `python -m MODULE args` would (normally `sgdjob_trainer --config FILE`). CUDA is never
initialised in the agent (the warm-up builds a CPU optimizer), so forked workers may use GPUs;
were it initialised, the workers are spawned instead.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import uuid

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

import sgdjob_trainer.trainer  # noqa: F401  (imported once here, inherited by every worker)
from sgdjob_trainer.wire.launch_contract import EXIT_RENDEZVOUS_CLOSED

# Signals torchrun's agent handles; a forked worker inherits the handlers and must not keep them.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def warm() -> None:
    """Import what the first optimizer imports (torch._dynamo, through add_param_group)."""
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


def run_module(module: str, *argv: str) -> None:
    """One worker, in a process forked from the agent with torchrun's environment set: `python -m
    MODULE argv`, ending with that module's exit status."""
    for sig in _AGENT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        # torchrun judges a worker by its exit status; a function that returns counts as success,
        # so only a successful exit may return.
        if done.code not in (None, 0):
            raise


def main(argv: list[str] | None = None) -> None:
    try:
        launch(argv)
    except RendezvousClosedError:
        # A node added as the job ended (a grow decided near the last step) finds the rendezvous
        # closed by the agents that finished; torchrun would call that a crash.
        print(
            "sgdjob agent: the rendezvous is closed: the job ended before this node joined a world; "
            f"exiting with status {EXIT_RENDEZVOUS_CLOSED}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_RENDEZVOUS_CLOSED)


@record  # as torchrun's main: a failed worker's error is printed, and the exit status is 1
def launch(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # type: ignore[no-untyped-call]
    if not args.module or args.no_python or args.run_path:
        sys.exit(
            "sgdjob_trainer.agent runs modules only: end the command with `-m MODULE [args]`, "
            "e.g. `-m sgdjob_trainer --config FILE`"
        )
    if args.standalone:  # as torchrun: a private c10d store on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:  # as torchrun: only the static rendezvous reads it
        args.master_port = 29500
    # torch.cuda.is_available() initialises the driver unless it asks NVML, and a forked child of
    # an initialised parent cannot use CUDA; nothing here asks, this keeps it so if torch does.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    warm()
    # Should CUDA be initialised anyway, spawn: each worker imports afresh (slower, never broken).
    args.start_method = "spawn" if torch.cuda.is_initialized() else "fork"  # type: ignore[no-untyped-call]
    config, _cmd, _cmd_args = config_from_args(args)
    sys.stdout.flush()
    sys.stderr.flush()
    elastic_launch(config=config, entrypoint=run_module)(args.training_script, *args.training_script_args)


if __name__ == "__main__":
    main()
