"""The real contract end to end: torchrun starts four `python -m sgdjob_trainer --config FILE`
processes; the test drives them over HTTP only (/status, /metrics, POST /control) through all six
ordered mode switches, then reads the per-rank report files."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bench.trainer_modes import SWITCH_SEQUENCE, free_port_base, launch, post_control, read_reports, wait_status
from sgdjob_operator.policy.efficiency import MIN_STEPS, estimate
from sgdjob_operator.workers.scrape import parse_metrics
from sgdjob_trainer.config import Compression
from sgdjob_trainer.networks import build_model
from sgdjob_trainer.strategies.base import exchange_bytes

pytestmark = pytest.mark.multiproc
TOKEN = "test-token"
NAMES = (
    "sgdjob_steps_total",
    "sgdjob_samples_total",
    "sgdjob_compute_seconds_total",
    "sgdjob_comm_wait_seconds_total",
    "sgdjob_step_seconds_bucket",
    "sgdjob_loss",
    "sgdjob_staleness_steps",
    "sgdjob_world_size 4.0",
    "sgdjob_batch_size",
    "sgdjob_control_epoch",
    'sgdjob_mode{mode="sync"} 1.0',
    'sgdjob_worker_info{local_rank="2"',
    "sgdjob_switches_total 0.0",
    "sgdjob_switch_pause_seconds_total",
)


def test_switch_through_every_pair_over_http(tmp_path: Path) -> None:
    port = free_port_base(4)
    config = {
        "jobName": "switch-test",
        "mode": "sync",
        "referenceWorldSize": 4,
        "training": {
            "steps": 300,
            "batchSize": 16,
            "metricsPort": port,
            # No groups given: measured speeds put the 2x slower rank 3 in a group of its own.
            "hierarchical": {"groupBy": "speed", "averageEvery": 2, "staleness": 1},
            "async": {"staleness": None},
            # Slow steps while the test switches over HTTP (a wide window on a loaded machine),
            # fast ones after, so the run ends soon once the switching is done.
            "emulation": {
                "computeSeconds": 0.01,
                "jitter": 0.1,
                "slowdowns": [{"rank": 3, "factor": 2.0}]
                + [{"rank": r, "factor": 4.0, "endStep": 150} for r in range(4)],
            },
        },
    }
    proc = launch(config, tmp_path, env={"SGDJOB_CONTROL_TOKEN": TOKEN})
    in_hierarchical: list[dict[str, Any]] = []
    in_async: list[tuple[int, list[dict[str, Any]]]] = []
    try:
        wait_status(port, 4, lambda docs: all(d["step"] >= MIN_STEPS + 2 for d in docs), 300, proc)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port + 2}/metrics", timeout=5).read().decode()
        for name in NAMES:
            assert name in metrics, name
        # What the policy's cost model is given: the bytes the synchronous allreduce sends, and
        # each rank's gradient statistics, which it averages into what a stale sample is worth.
        expected = exchange_bytes(list(build_model("mlp", 0).parameters()), Compression.NONE)
        sample = parse_metrics(metrics, time=0.0)
        assert sample.gradient_bytes == expected > 0
        assert sample.gradient is not None and sample.gradient.steps >= MIN_STEPS
        assert sample.gradient.variance > 0 and sample.gradient.lag_dot is not None
        efficiency = estimate([sample], penalty=0.02)
        assert efficiency.measured and efficiency.noise_scale is not None and efficiency.noise_scale > 0
        body = {"epoch": 1, "mode": SWITCH_SEQUENCE[0], "reason": "test"}
        assert post_control(port, body, None)[0] == 401
        assert post_control(port, body, "wrong")[0] == 401
        assert post_control(port + 1, body, TOKEN)[0] == 404, "only rank 0 takes commands"
        for epoch, mode in enumerate(SWITCH_SEQUENCE, start=1):
            body = {"epoch": epoch, "mode": mode, "reason": f"test switch {epoch}"}
            if epoch == 3:
                body["batchSizes"] = {"3": 8}
            assert post_control(port, body, TOKEN) == (202, {"accepted": epoch, "ignored": False})
            assert post_control(port, body, TOKEN)[1]["ignored"], "a re-push changes nothing"
            docs = wait_status(port, 4, lambda docs, m=mode: all(d["mode"] == m for d in docs), 120, proc)
            assert all(d["controlEpoch"] == epoch for d in docs)
            if epoch == 1:
                # Hierarchical measures too (gradient_stats): the group of three from its group
                # steps, afresh, so the policy does not judge it by the sync steps' figures.
                switched = max(d["step"] for d in docs)
                docs = wait_status(
                    port,
                    4,
                    lambda docs, s=switched: all(
                        d["step"] > s + 5 and d.get("gradientStatSteps", 0) >= 5 for d in docs[:3]
                    ),
                    60,
                    proc,
                )
                assert all(d["mode"] == "hierarchical" and d["gradientSqNorm"] > 0 for d in docs[:3]), docs
                in_hierarchical = docs
            if mode == "async":
                # Async measures its own gradient figures (each worker's consecutive gradients), so
                # the policy does not judge async by the synchronous figures from before it; until
                # its lags stand out of the samples' noise they are unknown, never the sync ones.
                docs = wait_status(
                    port, 4, lambda docs: all(d.get("gradientStatSteps", 0) >= 5 for d in docs), 60, proc
                )
                assert all(d["mode"] == "async" and d.get("gradientSqNorm", 1.0) > 0 for d in docs), docs
                in_async.append((epoch, docs))
        assert docs[3]["batchSize"] == 8 and docs[2]["batchSize"] == 16
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "hierarchical: groups [[0, 1, 2], [3]]" in (tmp_path / "log.txt").read_text()
    reports = read_reports(tmp_path / "report", 4)
    for r in reports:
        assert r["done"] and r["step"] == 300
        assert [m["mode"] for m in r["modeTimeline"]] == ["sync", *SWITCH_SEQUENCE]
        assert r["finalLoss"] < r["initialLoss"] / 5
        assert {"initialLoss", "finalLoss", "lossHistory", "wallSeconds", "speedSamplesPerS", "switches"} <= set(r)
    entered = reports[0]["switches"][0]["step"]
    for d in in_hierarchical[:3]:  # measured over hierarchical's own steps only
        assert d["gradientStatSteps"] <= d["step"] - entered + 1, (entered, d)
    assert in_async
    for epoch, docs in in_async:  # and async over its own
        entered = reports[0]["switches"][epoch - 1]["step"]
        assert all(d["gradientStatSteps"] <= d["step"] - entered for d in docs), (entered, docs)
    pairs = {(s["fromMode"], s["toMode"]) for s in reports[0]["switches"]}
    assert len(pairs) == 6
    for i in range(len(SWITCH_SEQUENCE)):
        assert len({r["switches"][i]["step"] for r in reports}) == 1, "every rank switched at the same step"
    assert reports[0]["finalLoss"] == reports[3]["finalLoss"], "one model on every rank at the end"
