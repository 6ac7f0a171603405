"""The `sgdjob` command line. Each subcommand lives in the module that owns its work."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sgdjob_operator import __version__
from sgdjob_operator.api.crd import render_crd
from sgdjob_operator.api.validation import SpecError, load_jobs


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sgdjob")
def main() -> None:
    """SGDJob: elastic PyTorch training that switches sync/hierarchical/async SGD at run time."""


@main.command()
def crd() -> None:
    """Print the SGDJob CustomResourceDefinition generated from the API models."""
    click.echo(render_crd(), nl=False)


@main.command()
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


# Subcommands live in the modules that own their work; each imports its heavy dependencies lazily.
from sgdjob_operator.cli_simulate import simulate  # noqa: E402
from sgdjob_operator.local.cli import run  # noqa: E402
from sgdjob_operator.operator_cli import operator  # noqa: E402

main.add_command(run)
main.add_command(operator)
main.add_command(simulate)
