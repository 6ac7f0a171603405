"""Fixtures of the local tiers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.local.example_runs import RunExample, run_example_in


@pytest.fixture
def run_example(tmp_path: Path) -> RunExample:
    def run(name: str, spec: dict[str, Any]) -> tuple[int, str, dict[str, Any] | None, Path]:
        return run_example_in(tmp_path, name, spec)

    return run
