"""Loaded for every test directory (tests/ and e2e/): the local cluster's pytest plugin
(devcluster/pytest_plugin.py: `k8s`, `k8s_assets`, `cluster`, `real_cluster`) and the session's summary:
measured figures (tests/figures.py), then what each tier cost (CI's budget)."""

from __future__ import annotations

import pytest

from tests.figures import FIGURES

pytest_plugins = ["devcluster.pytest_plugin"]

_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's time (setup, call, teardown) to its module's total, for the tier summary."""
    module = report.nodeid.split("::", 1)[0]
    _SPENT[module] = _SPENT.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Measured figures, then what each tier (tests/<dir>, e2e) and its costliest modules cost (CI's budget)."""
    for title, text in FIGURES.items():
        terminalreporter.section(title)
        terminalreporter.write_line(text)
    if not _SPENT:
        return
    tiers: dict[str, float] = {}
    for module, spent in _SPENT.items():
        tier = "/".join(module.split("/")[:2])
        tiers[tier] = tiers.get(tier, 0.0) + spent
    terminalreporter.section("time per tier (setup + call + teardown)")
    for tier, spent in sorted(tiers.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{spent:8.1f}s  {tier}")
    terminalreporter.section("costliest modules")
    for module, spent in sorted(_SPENT.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{spent:8.1f}s  {module}")
