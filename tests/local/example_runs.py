"""Helpers of the local tiers: run an example job with `sgdjob run`, edited for the test, and find
processes a run left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
SGDJOB = str(Path(sys.executable).parent / "sgdjob")  # the console script of this environment

# (example file name, spec changes) -> (exit code, stdout + stderr, report or None, output dir)
RunExample = Callable[[str, dict[str, Any]], tuple[int, str, dict[str, Any] | None, Path]]


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains `text` (a run's output directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def run_example_in(tmp_path: Path, name: str, spec: dict[str, Any]) -> tuple[int, str, dict[str, Any] | None, Path]:
    job = yaml.safe_load((REPO / "examples" / name).read_text())
    _merge(job["spec"], spec)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    proc = subprocess.run(
        [SGDJOB, "run", str(path), "--out", str(out), "--timeout", "500"],
        capture_output=True,
        text=True,
        timeout=560,
        cwd=tmp_path,
    )
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, report, out
