"""`sgdjob validate FILE...`: the operator's own checks, offline."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sgdjob_operator.api.validation import SpecError, load_jobs, spec_warnings


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def validate(files: tuple[Path, ...]) -> None:
    """Check SGDJob files with the operator's own rules; exit 1 naming each bad field. Warnings (allowed,
    but not doing what the spec seems to ask) go to stderr and do not change the exit status."""
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
            for warning in spec_warnings(job.spec):
                click.echo(f"{path}: warning: {warning.message}", err=True)
    if failed:
        sys.exit(1)
