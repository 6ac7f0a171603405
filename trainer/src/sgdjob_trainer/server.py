"""Per-process HTTP server: GET /metrics, GET /status, GET /healthz and (rank 0) POST /control.

Port: base + LOCAL_RANK, where base is env SGDJOB_METRICS_PORT if set, else training.metricsPort
(torchrun gives all local workers one environment, so the local rank keeps their ports apart; a
base of 0 binds an ephemeral port per process, logged and shown in /status as `port`). Host: env
SGDJOB_METRICS_HOST, default 0.0.0.0.

/control needs `Authorization: Bearer <token>`; the token is env SGDJOB_CONTROL_TOKEN or the
content of the file named by SGDJOB_CONTROL_TOKEN_FILE (re-read per request, so a rotated Secret
takes effect). No token configured: 403 (control disabled). Wrong or missing token: 401.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from sgdjob_trainer.config import TrainingConfig
from sgdjob_trainer.telemetry import Telemetry
from sgdjob_trainer.wire.control import ControlCommand, merge
from sgdjob_trainer.wire.launch_contract import ENV_CONTROL_TOKEN, ENV_CONTROL_TOKEN_FILE, ENV_METRICS_PORT

log = logging.getLogger("sgdjob_trainer.server")
MAX_BODY = 1 << 20


def metrics_port(training: TrainingConfig, local_rank: int) -> int:
    """SGDJOB_METRICS_PORT (else training.metricsPort) plus the local rank; 0 means ephemeral."""
    raw = os.environ.get(ENV_METRICS_PORT)
    base = int(raw) if raw not in (None, "") else training.metrics_port
    return 0 if base == 0 else base + local_rank


def control_token() -> str | None:
    token = os.environ.get(ENV_CONTROL_TOKEN)
    if token:
        return token.strip()
    path = os.environ.get(ENV_CONTROL_TOKEN_FILE)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError as err:
            log.warning("cannot read control token file %s: %s", path, err)
    return None


class ControlInbox:
    """Commands accepted on rank 0 and not yet applied. Epochs order them: anything at or below the
    newest epoch seen is a re-push and changes nothing; commands that arrive before the next switch
    point are merged (later fields win), so a mode change and a rebalance sent back to back both land."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.applied_epoch = 0
        self._pending: ControlCommand | None = None

    def offer(self, command: ControlCommand) -> bool:
        with self._lock:
            newest = max(self.applied_epoch, self._pending.epoch if self._pending else 0)
            if command.epoch <= newest:
                return False
            self._pending = merge(self._pending, command)
            return True

    def pending_epoch(self) -> int:
        with self._lock:
            return self._pending.epoch if self._pending else 0

    def take(self) -> ControlCommand | None:
        with self._lock:
            command, self._pending = self._pending, None
            if command is not None:
                self.applied_epoch = command.epoch
            return command

    def mark_applied(self, epoch: int) -> None:
        with self._lock:
            self.applied_epoch = max(self.applied_epoch, epoch)


# How often the serving loop looks for a stop. `stop` waits for that look, and every worker stops
# its server on the way out of a restart (a rescale, a replacement, a lost peer): at socketserver's
# default of 0.5 s a worker's exit waited up to 0.5 s after its last step (0.2 s measured), with the
# pause of a rescale on 3 real nodes 1.3-1.5 s. The loop's wake-ups cost nothing measurable here.
STOP_POLL_SECONDS = 0.02


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that hangs up before its answer is written (a timeout, the operator restarting)
        # is routine; socketserver would print a traceback to the worker's log for each one.
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("client %s hung up early", client_address)
            return
        log.exception("error serving %s", client_address)


class TrainerServer:
    """A ThreadingHTTPServer on a daemon thread; reads only thread-safe state (Telemetry, inbox)."""

    def __init__(self, telemetry: Telemetry, inbox: ControlInbox | None, host: str, port: int) -> None:
        self.telemetry = telemetry
        self.inbox = inbox
        handler = _make_handler(self)
        try:
            self.httpd = _Server((host, port), handler)
        except OSError as err:
            raise RuntimeError(
                f"cannot serve /metrics on {host}:{port} ({err}); "
                "choose another SGDJOB_METRICS_PORT or training.metricsPort"
            ) from err
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(STOP_POLL_SECONDS,), name="sgdjob-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        log.info("serving /metrics /status%s on port %d", " /control" if self.inbox else "", self.port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(server: TrainerServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _reply(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="sgdjob"')
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, doc: dict[str, Any]) -> None:
            self._reply(code, json.dumps(doc).encode())

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, server.telemetry.render_metrics(), CONTENT_TYPE_LATEST)
            elif path == "/status":
                self._json(200, server.telemetry.status().model_copy(update={"port": server.port}).document())
            elif path == "/healthz":
                self._reply(200, b"ok\n", "text/plain")
            else:
                self._json(404, {"error": f"no such endpoint {path}"})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path != "/control":
                self._json(404, {"error": f"no such endpoint {path}"})
                return
            if server.inbox is None:
                self._json(404, {"error": "control is served by rank 0 only"})
                return
            token = control_token()
            if token is None:
                self._json(
                    403, {"error": "control disabled: no SGDJOB_CONTROL_TOKEN or SGDJOB_CONTROL_TOKEN_FILE configured"}
                )
                return
            header = self.headers.get("Authorization", "")
            given = header[7:].strip() if header.lower().startswith("bearer ") else ""
            if not given or not hmac.compare_digest(given.encode(), token.encode()):
                self._json(401, {"error": "missing or wrong bearer token"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                self._json(400, {"error": "a JSON ControlCommand body is required"})
                return
            try:
                command = ControlCommand.model_validate_json(self.rfile.read(length))
            except ValidationError as err:
                self._json(400, {"error": "invalid ControlCommand", "details": json.loads(err.json())})
                return
            fresh = server.inbox.offer(command)
            if fresh:
                log.info(
                    "control command accepted: epoch %d mode %s reason %r", command.epoch, command.mode, command.reason
                )
            self._json(202, {"accepted": command.epoch, "ignored": not fresh})

    return Handler
