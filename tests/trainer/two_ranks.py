"""Helper of the integrations' weighting tests: run a script on 2 torchrun ranks (gloo, standalone)
outside any job and read the JSON its rank 0 prints on a line starting with `RESULT `."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def results_of(script: Path, cwd: Path) -> dict[str, Any]:
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "SGDJOB_METRICS_PORT": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("SGDJOB_RUN_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True, text=True, timeout=240, cwd=cwd, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    results: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return results
