"""The per-process HTTP server on its own: metric names, /status fields, /control authentication."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.trainer_modes import get_json, post_control
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.server import ControlInbox, TrainerServer
from sgdjob_trainer.telemetry import Telemetry

METRICS = (
    "sgdjob_steps_total",
    "sgdjob_samples_total",
    "sgdjob_compute_seconds_total",
    "sgdjob_comm_wait_seconds_total",
    "sgdjob_step_seconds_bucket",
    "sgdjob_loss",
    "sgdjob_staleness_steps",
    "sgdjob_world_size",
    "sgdjob_batch_size",
    "sgdjob_control_epoch",
    'sgdjob_mode{mode="sync"} 0.0',
    'sgdjob_mode{mode="async"} 1.0',
    'sgdjob_worker_info{local_rank="0",node="node-a",rank="0"} 1.0',
    "sgdjob_switches_total 1.0",
    "sgdjob_switch_pause_seconds_total 0.25",
)
STATUS = (
    "rank",
    "localRank",
    "worldSize",
    "node",
    "mode",
    "step",
    "samples",
    "computeSeconds",
    "commWaitSeconds",
    "loss",
    "staleness",
    "batchSize",
    "controlEpoch",
    "switches",
    "done",
    "time",
)


@pytest.fixture
def served() -> Iterator[tuple[Telemetry, ControlInbox, int]]:
    telemetry = Telemetry(WorldInfo(0, 0, 4, 4, 0, 0, "node-a"), SyncMode.SYNC, 32)
    inbox = ControlInbox()
    server = TrainerServer(telemetry, inbox, "127.0.0.1", 0)
    server.start()
    yield telemetry, inbox, server.port
    server.stop()


def test_metrics_and_status(served: tuple[Telemetry, ControlInbox, int], tmp_path: Path) -> None:
    telemetry, _, port = served
    telemetry.record_step(1, 32, 0.06, 0.01, 0.07, 1.5, 0.0)
    telemetry.record_step(2, 32, 0.05, 0.02, 0.07, 1.2, 2.0)
    telemetry.record_switch(SyncMode.SYNC, SyncMode.ASYNC, 2, 0.25, "straggler")
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in METRICS:
        assert name in text, name
    assert "sgdjob_samples_total 64.0" in text and "_created" not in text
    status = get_json(f"http://127.0.0.1:{port}/status")
    assert set(STATUS) <= set(status)
    assert (status["step"], status["samples"], status["mode"], status["loss"]) == (2, 64, "async", 1.2)
    assert status["computeSeconds"] == pytest.approx(0.11)
    assert status["switches"][0] | {"timeS": 0} == {
        "fromMode": "sync",
        "toMode": "async",
        "step": 2,
        "pauseS": 0.25,
        "reason": "straggler",
        "timeS": 0,
    }
    telemetry.finish(0.5)
    doc = json.loads(telemetry.write_report(str(tmp_path)).read_text())
    assert doc["done"] and doc["finalLoss"] == 0.5 and [h[:2] for h in doc["lossHistory"]] == [[1, 1.5], [2, 1.2]]
    assert all(0 <= h[2] < 60 for h in doc["lossHistory"])  # seconds since the process started
    assert [m["mode"] for m in doc["modeTimeline"]] == ["sync", "async"]
    assert doc["speedSamplesPerS"] == pytest.approx(64 / 0.11)
    assert not list(tmp_path.glob(".*tmp")), "written through a temp file and renamed"


def test_control_needs_the_token(
    served: tuple[Telemetry, ControlInbox, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, inbox, port = served
    body = {"epoch": 3, "mode": "async", "groups": [[0, 1], [2, 3]], "batchSizes": {"3": 16}, "reason": "test"}
    monkeypatch.delenv("SGDJOB_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("SGDJOB_CONTROL_TOKEN_FILE", raising=False)
    assert post_control(port, body, "x")[0] == 403, "no token configured: control disabled"
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    monkeypatch.setenv("SGDJOB_CONTROL_TOKEN_FILE", str(token_file))
    assert post_control(port, body, None)[0] == 401
    assert post_control(port, body, "wrong")[0] == 401
    assert inbox.pending_epoch() == 0
    assert post_control(port, body, "s3cret") == (202, {"accepted": 3, "ignored": False})
    assert post_control(port, body, "s3cret") == (202, {"accepted": 3, "ignored": True}), "idempotent re-push"
    assert post_control(port, {"epoch": -1}, "s3cret")[0] == 400
    command = inbox.take()
    assert command is not None and command.batch_sizes == {3: 16} and command.groups == [[0, 1], [2, 3]]
    monkeypatch.setenv("SGDJOB_CONTROL_TOKEN", "envtoken")
    assert post_control(port, {"epoch": 4}, "envtoken")[0] == 202, "env token wins over the file"


def test_control_only_on_rank_zero() -> None:
    telemetry = Telemetry(WorldInfo(1, 1, 4, 4, 0, 0, "n"), SyncMode.SYNC, 32)
    server = TrainerServer(telemetry, None, "127.0.0.1", 0)
    server.start()
    try:
        assert post_control(server.port, {"epoch": 1}, "t")[0] == 404
    finally:
        server.stop()


def test_a_scraper_hanging_up_early_leaves_no_traceback(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    server = TrainerServer(Telemetry(WorldInfo(1, 1, 4, 4, 0, 0, "n"), SyncMode.SYNC, 32), None, "127.0.0.1", 0)
    try:
        for error in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "Connection reset by peer")):
            try:
                raise error
            except ConnectionError:
                server.httpd.handle_error(None, ("127.0.0.1", 40000))
        assert capsys.readouterr().err == "" and not [r for r in caplog.records if r.levelname == "ERROR"]
        try:
            raise ValueError("a real fault")
        except ValueError:
            server.httpd.handle_error(None, ("127.0.0.1", 40000))
        assert "error serving" in caplog.text and "a real fault" in caplog.text
    finally:
        server.httpd.server_close()
