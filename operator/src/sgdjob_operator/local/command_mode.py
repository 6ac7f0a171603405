"""Command mode for `sgdjob run` (spec.training.command), as pure functions: the program each
agent execs, whether it can start at all, and what the run tells the user about it.

The user's script runs unmodified under our torchrun agent (`--no-python CMD args`): torchrun's
environment contract, elastic min/max, restarts and lost agents work as for the trainer. The
script does not report to SGDJob (no /metrics), so the auto policy is off: no mode switch, no
rebalance, no straggler decision. From outside, only a process's liveness is observable: a worker
that exits is a failure torchrun restarts; one that is stuck in a collective stays until the
script's own collective timeout ends it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from sgdjob_trainer.wire.launch_contract import ADAPTATION_API_NOTE, COMMAND_MODE_NOTE

# `python` in a job file means the interpreter `sgdjob run` runs under (which has torch), not
# whatever `python` the shell's PATH finds first; on a cluster it is the image's own.
PYTHON_NAMES = frozenset({"python", "python3"})


def local_command(command: Sequence[str], python: str) -> tuple[str, ...]:
    """The argv each local worker execs: `command`, its leading `python`/`python3` replaced by `python`."""
    program, *rest = command
    return (python if program in PYTHON_NAMES else program, *rest)


def command_problem(command: Sequence[str], work_dir: Path, path: str) -> str | None:
    """Why `command` cannot start in `work_dir` with PATH `path`, naming the field and the fix; None
    when it can. A program with a slash is a file relative to the working directory, as a shell
    finds it; a bare name is looked up on PATH."""
    program = command[0]
    if os.sep in program:
        file = work_dir / program
        if file.is_file() and os.access(file, os.X_OK):
            return None
        what = "is not an executable file" if file.exists() else "does not exist"
        return f"spec.training.command[0]: {program!r} {what} (in {work_dir}); fix the path or chmod +x it"
    if shutil.which(program, path=path) is not None:
        return None
    return (
        f"spec.training.command[0]: {program!r} was not found on PATH; "
        "give an installed program (e.g. [python, train.py]) or a path to your script"
    )


def script_problem(command: Sequence[str], work_dir: Path) -> str | None:
    """`[python, train.py ...]` whose train.py is not in the working directory: python would say
    so only after every agent has started; say it first."""
    if len(command) < 2 or command[0] not in PYTHON_NAMES or command[1].startswith("-"):
        return None
    script = work_dir / command[1]
    if script.is_file():
        return None
    return (
        f"spec.training.command[1]: {command[1]!r} does not exist in {work_dir} (the job file's folder); fix the path"
    )


def command_check(command: Sequence[str], work_dir: Path, python: str, path: str) -> str | None:
    """Every reason the command cannot start, before any agent starts (None: it can)."""
    return command_problem(local_command(command, python), work_dir, path) or script_problem(command, work_dir)


def run_note(work_dir: Path, api: bool = False) -> str:
    """What `sgdjob run` prints at the start of a command-mode run (`api`: on the adaptation API)."""
    if api:
        return f"{ADAPTATION_API_NOTE}; the script runs in {work_dir}"
    return f"{COMMAND_MODE_NOTE}; only a process's liveness is watched; the script runs in {work_dir}"
