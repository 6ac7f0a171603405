"""The `sgdjob` command line: one module per subcommand, each importing its heavy dependencies
(kopf, torch, numpy) only when it runs, so `sgdjob validate` starts fast in any image."""

from __future__ import annotations

import click

from sgdjob_operator import __version__
from sgdjob_operator.cli.crd import crd
from sgdjob_operator.cli.operator import operator
from sgdjob_operator.cli.run import run
from sgdjob_operator.cli.simulate import simulate
from sgdjob_operator.cli.validate import validate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sgdjob")
def main() -> None:
    """SGDJob: elastic PyTorch training that switches sync/hierarchical/async SGD at run time."""


for command in (validate, crd, run, simulate, operator):
    main.add_command(command)
