"""`sgdjob validate FILE...`: the operator's own checks, offline."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sgdjob_operator.api.validation import SpecError, load_jobs


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def validate(files: tuple[Path, ...]) -> None:
    """Check SGDJob files with the operator's own rules; exit 1 naming each bad field."""
    failed = False
    for path in files:
        try:
            jobs = load_jobs(path)
        except SpecError as err:
            failed = True
            for problem in err.problems:
                click.echo(f"{path}: {problem}", err=True)
            continue
        for job in jobs:
            name = job.metadata.get("name", "?")
            click.echo(f"{path}: SGDJob {name} is valid ({job.spec.replicas} workers, mode {job.spec.mode.value})")
    if failed:
        sys.exit(1)
