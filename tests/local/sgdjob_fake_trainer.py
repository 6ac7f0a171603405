"""A stand-in for `python -m sgdjob_trainer` in runner tests: same command line, environment and
HTTP /status contract, no torch. It records its pids so a test can check that nothing survives.

FAKE_STEPS=n: run n steps of FAKE_STEP_S seconds, write rank-<rank>.json and exit 0 (else run
until killed). FAKE_FAIL_RANK=r: that rank exits 3 after its steps. FAKE_IGNORE_TERM=1: ignore
SIGTERM, so only SIGKILL ends it. Every process also starts a grandchild in a session of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BATCH = 8


def main() -> int:
    config = json.loads(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    port = int(config["training"]["metricsPort"]) + local_rank
    report_dir = Path(os.environ["SGDJOB_REPORT_DIR"])
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (report_dir / f"pids-{rank}.json").write_text(
        json.dumps({"worker": os.getpid(), "agent": os.getppid(), "grandchild": child.pid})
    )
    state: dict[str, Any] = {"rank": rank, "localRank": local_rank, "worldSize": int(os.environ["WORLD_SIZE"]),
                             "node": os.environ["NODE_NAME"], "mode": config["mode"], "step": 0, "samples": 0,
                             "computeSeconds": 0.0, "commWaitSeconds": 0.0, "loss": 1.0, "done": False,
                             "startTime": time.time()}  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({**state, "time": time.time()}).encode()
            self.send_response(200 if self.path == "/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((os.environ.get("SGDJOB_METRICS_HOST", "127.0.0.1"), port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    steps = int(os.environ.get("FAKE_STEPS", "0"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.05")) * (1 + rank)
    start = time.monotonic()
    while steps == 0 or state["step"] < steps:
        time.sleep(step_s)
        state.update(
            step=state["step"] + 1, samples=state["samples"] + BATCH, computeSeconds=state["computeSeconds"] + step_s
        )
        state["loss"] = 1.0 / (1 + state["step"])
    state.update(done=True, initialLoss=1.0, finalLoss=state["loss"], wallSeconds=time.monotonic() - start,
                 modeTimeline=[{"timeS": 0.0, "step": 0, "mode": config["mode"], "reason": "start"}])  # fmt: skip
    (report_dir / f"rank-{rank}.json").write_text(json.dumps(state))
    child.kill()
    return 3 if os.environ.get("FAKE_FAIL_RANK") == str(rank) else 0


if __name__ == "__main__":
    sys.exit(main())
