"""How the operator loads: the `sgdjob` CLI does not pay for kopf; `kopf run -m sgdjob_operator.k8s`
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


def test_kopf_loading_the_k8s_package_registers_handlers() -> None:
    _python("import sys, kopf, sgdjob_operator.k8s; assert 'sgdjob_operator.k8s.handlers' in sys.modules")


def test_other_subpackages_register_no_handlers() -> None:
    """A process that has kopf loaded (a test, a user's own operator) can use the local shell, the
    simulator or the policy without our handlers joining its registry."""
    imports = (
        "sgdjob_operator, sgdjob_operator.local.runner, sgdjob_operator.sim, sgdjob_operator.policy, "
        "sgdjob_operator.workers.scrape, sgdjob_operator.cli"
    )
    _python(f"import sys, kopf, {imports}; assert 'sgdjob_operator.k8s.handlers' not in sys.modules")


def test_operator_command_options() -> None:
    runner = CliRunner()
    assert "--all-namespaces" in runner.invoke(main, ["operator", "--help"]).output
    result = runner.invoke(main, ["operator", "-n", "a", "--all-namespaces"])
    assert result.exit_code != 0 and "not both" in result.output
