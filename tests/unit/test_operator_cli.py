"""How the operator loads: the `sgdjob` CLI does not pay for kopf; `kopf run -m sgdjob_operator`
registers the handlers; `sgdjob operator` refuses contradictory options."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from sgdjob_operator.cli import main


def _python(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_cli_import_does_not_load_kopf() -> None:
    _python("import sys, sgdjob_operator.cli; assert 'kopf' not in sys.modules, 'kopf loaded'")


def test_kopf_loading_the_package_registers_handlers() -> None:
    _python("import sys, kopf, sgdjob_operator; assert 'sgdjob_operator.handlers' in sys.modules")


def test_operator_command_options() -> None:
    runner = CliRunner()
    assert "--all-namespaces" in runner.invoke(main, ["operator", "--help"]).output
    result = runner.invoke(main, ["operator", "-n", "a", "--all-namespaces"])
    assert result.exit_code != 0 and "not both" in result.output
