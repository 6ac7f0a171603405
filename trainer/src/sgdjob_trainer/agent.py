"""`python -m sgdjob_trainer.agent [torchrun options] -m MODULE [args]`: torchrun whose workers are
forked from an agent that has already imported torch and the trainer.

Same options, rendezvous, restarts and exit status as `torchrun`; the only difference is how a
worker process starts. torchrun execs a fresh interpreter per worker, and each one imports torch
and, at its first optimizer, torch's compiler stack (about 6 s of CPU together); here the agent
pays that once, before any rendezvous, and every worker of every restart is a fork of it that runs
MODULE as `python -m MODULE args` would (normally `sgdjob_trainer --config FILE`). CUDA is never
initialised in the agent (the warm-up builds a CPU optimizer), so forked workers may use GPUs;
were it initialised, the workers are spawned instead.

Command mode (`--no-python CMD [args]`, the SGDJob's training.command): each worker execs CMD as
torchrun does, so a user's script runs as a normal process, unmodified. A CMD not on PATH exits
127 before any rendezvous, saying so; a worker that fails ends the agent with the worker's own
exit status (torchrun would exit 1), so the job's message can name the script's code; but a script
that exits `EXIT_RENDEZVOUS_TIMEOUT` ends the agent with 1, since that status means missing peers
(below) and is not counted against backoffLimit, so a script's crash loop must not exit with it.

Two ends are no failure of this node, and exit with statuses of their own instead of torchrun's 1:
a rendezvous already closed (the job ended before this node joined: `EXIT_RENDEZVOUS_CLOSED`) and a
rendezvous that timed out (fewer than the minimum of nodes joined within its join timeout, its
peers missing: `EXIT_RENDEZVOUS_TIMEOUT`). Controllers do not count those against backoffLimit.
"""

from __future__ import annotations

import logging
import os
import runpy
import shutil
import signal
import sys
import uuid
from typing import Any, NoReturn

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

import sgdjob_trainer.trainer  # noqa: F401  (imported once here, inherited by every worker)
from sgdjob_trainer import rendezvous_rounds
from sgdjob_trainer.wire.launch_contract import (
    ENV_TERMINATION_LOG,
    EXIT_COMMAND_NOT_FOUND,
    EXIT_RENDEZVOUS_CLOSED,
    EXIT_RENDEZVOUS_TIMEOUT,
    RDZV_BACKEND,
)

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
    except RendezvousTimeoutError:
        # A survivor whose peers vanished (a lost node's pods deleted, their replacements not yet
        # scheduled) waits the join timeout for the minimum of nodes; torchrun would call that a crash.
        give_up(world_not_formed(argv), EXIT_RENDEZVOUS_TIMEOUT)


def world_not_formed(argv: list[str] | None) -> str:
    """What a rendezvous that timed out means, with the job's terms where its options say them."""
    try:
        args = parse_args(argv)  # type: ignore[no-untyped-call]
        min_nodes = parse_min_max_nnodes(args.nnodes)[0]
        join_s = _parse_rendezvous_config(args.rdzv_conf).get("join_timeout", "600")
        terms = f"fewer than the minimum of {min_nodes} nodes joined the rendezvous within its timeout ({join_s} s)"
    except (SystemExit, Exception):  # unreadable options: the launch would have failed before
        terms = "fewer than the minimum of nodes joined the rendezvous within its timeout"
    return (
        f"the world could not form: {terms}; its peers are missing (a lost node, a worker not yet "
        f"scheduled); exiting with status {EXIT_RENDEZVOUS_TIMEOUT}"
    )


def give_up(message: str, status: int) -> NoReturn:
    """Exit with `status`, saying why on stderr and in the termination log (the pod's termination
    message, what `kubectl describe` shows), where the environment names one."""
    print(f"sgdjob agent: {message}", file=sys.stderr, flush=True)
    log = os.environ.get(ENV_TERMINATION_LOG)
    if log:
        with open(log, "w") as out:
            out.write(message + "\n")
    sys.exit(status)


# A worker dies with its agent, as a container's processes die with the container: an agent killed
# with SIGKILL (a lost node) must not leave its workers training on in a world that has moved on.
# PR_SET_PDEATHSIG (1) survives the exec into the user's program.
_DIE_WITH_AGENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); os.execvp(sys.argv[1], sys.argv[1:])"
)


def worker_argv(program: str, argv: list[str]) -> tuple[str, list[str]]:
    """What torchrun execs per worker: `program argv`, made to die with its agent on Linux."""
    if not sys.platform.startswith("linux"):
        return program, argv
    return sys.executable, ["-c", _DIE_WITH_AGENT, program, *argv]


def command_not_found(program: str) -> str | None:
    """Why training.command's program cannot start here (None when it can)."""
    if shutil.which(program) is not None:
        return None
    where = "is not an executable file" if os.sep in program else "was not found on PATH"
    return (
        f"spec.training.command: {program!r} {where} (PATH={os.environ.get('PATH', '')}); "
        "fix the command's first item or install it in the worker image"
    )


def run_command(config: LaunchConfig, program: str, argv: list[str]) -> None:
    """Command mode: every worker execs `program argv` (torchrun's own --no-python path)."""
    problem = command_not_found(program)
    if problem is not None:
        give_up(problem, EXIT_COMMAND_NOT_FOUND)
    entrypoint, args = worker_argv(program, argv)
    try:
        run_agent(config, entrypoint, *args)
    except ChildFailedError as failed:
        print(failed.format_msg(), file=sys.stderr, flush=True)  # type: ignore[no-untyped-call]
        first = failed.get_first_failure()[1]
        code = first.exitcode if first.exitcode > 0 else 1
        if code == EXIT_RENDEZVOUS_TIMEOUT:  # the script's own 4 is its failure, not missing peers
            print(f"sgdjob agent: the program exited {code}, which the agent reserves; exiting 1", file=sys.stderr)
            code = 1
        sys.exit(code)


def run_agent(config: LaunchConfig, entrypoint: Any, *args: str) -> None:
    """torchrun's agent on the c10d rendezvous of `rendezvous_rounds`: rounds complete at the job's
    intended size instead of waiting torch's last call."""
    if config.rdzv_backend == RDZV_BACKEND:
        config.rdzv_backend = rendezvous_rounds.register()
        # Its decisions (a round completed at the intended size, a removed peer dropped) in the
        # agent's log, beside torch's own lines; nothing else of ours logs in the agent.
        said = logging.getLogger(rendezvous_rounds.__name__)
        if not said.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[sgdjob agent] %(message)s"))
            said.addHandler(handler)
            said.setLevel(logging.INFO)
            said.propagate = False
    elastic_launch(config=config, entrypoint=entrypoint)(*args)


@record  # as torchrun's main: a failed worker's error is printed, and the exit status is 1
def launch(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # type: ignore[no-untyped-call]
    if args.run_path or not (args.module or args.no_python):
        sys.exit(
            "sgdjob_trainer.agent runs modules or programs: end the command with `-m MODULE [args]` "
            "(e.g. `-m sgdjob_trainer --config FILE`) or `--no-python PROGRAM [args]`"
        )
    if args.no_python:
        args.module = False
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
    config, cmd, cmd_args = config_from_args(args)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.no_python:
        run_command(config, str(cmd), cmd_args)  # a program's name (config_from_args: not a callable)
        return
    run_agent(config, run_module, args.training_script, *args.training_script_args)


if __name__ == "__main__":
    main()
