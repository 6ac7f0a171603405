"""Reading a Prometheus that a test started: readiness and instant queries over its HTTP API."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> bool:
    """Prometheus answers /-/ready once its storage is open; on a fresh machine that can take longer
    than the job takes to report steps. An exited process fails at once, with its log."""
    if proc.poll() is not None:
        raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:  # refused while it starts, 503 while it replays its storage
        return False
