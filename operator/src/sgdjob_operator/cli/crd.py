"""`sgdjob crd`: print the CRD generated from the API models."""

from __future__ import annotations

import click

from sgdjob_operator.api.crd import render_crd


@click.command()
def crd() -> None:
    """Print the SGDJob CustomResourceDefinition generated from the API models."""
    click.echo(render_crd(), nl=False)
