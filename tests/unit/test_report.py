"""Pure parts of the local runner: report aggregation, progress snapshots, launch planning."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import socket
from pathlib import Path
from typing import Any

import pytest

from sgdjob_operator.api.models import JobMode, SGDJob
from sgdjob_operator.api.validation import validate_job
from sgdjob_operator.local.auto import AutoController, training_start
from sgdjob_operator.local.launch import plan_launch, resolve_mode
from sgdjob_operator.local.procs import PORT_FLOOR, ephemeral_ports, free_port_blocks
from sgdjob_operator.local.progress import PlainDisplay, ProgressFrame, RunInfo, summarize
from sgdjob_operator.local.report import (
    build_report,
    final_world,
    mode_timeline,
    summary_lines,
    with_status_fallback,
)
from sgdjob_operator.workers.scrape import Endpoint, ScrapeResult
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.launch_contract import RunConfig
from sgdjob_trainer.wire.worker_status import WorkerStatus
from tests.unit.policy_feed import INTERVAL, STRAGGLER, feed, spec_for
from tests.unit.test_shells import FakeRun

EMULATION = {"computeSeconds": 0.05, "jitter": 0.0, "slowdowns": [{"rank": 1, "factor": 3.0}]}


def rank_doc(rank: int, samples: int, compute: float, wait: float, wall: float, **kw: Any) -> dict[str, Any]:
    doc = {"rank": rank, "node": f"local-{rank}", "step": samples // 32, "samples": samples,
           "computeSeconds": compute, "commWaitSeconds": wait, "wallSeconds": wall, "initialLoss": 2.0 + rank,
           "finalLoss": 0.5 + rank}  # fmt: skip
    doc.update(kw)
    return doc


def test_report_figures_follow_the_definitions() -> None:
    # rank 0: 3200 samples in 10 s of compute (320/s); rank 1: 3x slower, 1600 samples in 15 s (106.7/s).
    timeline = [{"timeS": 0.0, "step": 0, "mode": "async", "reason": "start"}]
    docs = [
        rank_doc(1, 1600, 15.0, 0.5, 15.5),
        rank_doc(0, 3200, 10.0, 1.0, 16.0, modeTimeline=timeline, lossHistory=[[0, 2.0], [99, 0.5]]),
    ]
    report = build_report(docs, job="j", mode="async", expected_workers=2, emulation=EMULATION)
    assert report["wall_s"] == 16.0
    assert report["throughput_samples_per_s"] == pytest.approx(4800 / 16.0)
    assert report["bound_samples_per_s"] == pytest.approx(320.0 + 1600 / 15.0)
    assert report["efficiency"] == pytest.approx(300.0 / (320.0 + 1600 / 15.0))
    assert (report["initial_loss"], report["final_loss"]) == (2.5, 1.0)
    assert report["steps"] == 100 and report["samples"] == 4800
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert report["per_rank"][1] == {"rank": 1, "node": "local-1", "speed_samples_per_s": pytest.approx(1600 / 15.0),
                                     "compute_s": 15.0, "wait_s": 0.5, "samples": 1600, "steps": 50, "batch_size": 0,
                                     "wall_s": 15.5, "final_loss": 1.5}  # fmt: skip
    assert report["mode_timeline"] == [{"time_s": 0.0, "step": 0, "mode": "async", "reason": "start"}]
    assert report["emulation"] == EMULATION and report["missing_ranks"] == [] and report["diverged_ranks"] == []
    assert report["loss_history"] == [[0, 2.0], [99, 0.5]]
    assert any("efficiency 0.70" in line for line in summary_lines(report))


def test_report_lists_missing_ranks_and_never_divides_by_zero() -> None:
    report = build_report(
        [rank_doc(0, 0, 0.0, 0.0, 0.0, finalLoss=None)],
        job="j",
        mode="sync",
        expected_workers=3,
        emulation=None,
        fallback_wall_s=0.0,
    )
    assert report["missing_ranks"] == [1, 2]
    assert report["throughput_samples_per_s"] == 0.0 and report["efficiency"] == 0.0 and report["final_loss"] is None
    assert report["emulation"] is None and report["diverged_ranks"] == [0]
    blown = rank_doc(1, 64, 1.0, 0.0, 1.0, lossHistory=[[1, 2.0], [2, None], [3, 5.0]])
    report = build_report(
        [rank_doc(0, 64, 1.0, 0.0, 1.0, lossHistory=[[1, 2.0]]), blown],
        job="j",
        mode="sync",
        expected_workers=2,
        emulation=None,
    )
    assert report["diverged_ranks"] == [1] and any("DIVERGED" in line for line in summary_lines(report))
    assert build_report([], job="j", mode="sync", expected_workers=1, emulation=None)["workers"] == 0


def test_an_auto_report_times_its_first_decision_from_the_training_start() -> None:
    decisions = [
        {"time_s": 9.5, "step": 38, "action": "switchMode", "mode": "async", "reason": "r", "applied": True},
        {"time_s": 30.0, "step": 150, "action": "rebalance", "reason": "r", "applied": True},
    ]
    docs = [rank_doc(0, 3200, 10.0, 1.0, 16.0)]
    extra = {"mode": "auto", "decisions": decisions, "training_start_s": 3.25}
    report = build_report(docs, job="j", mode="sync", expected_workers=1, emulation=None, extra=extra)
    assert report["first_decision"] == {"time_s": 6.25, "step": 38, "action": "switchMode", "run_time_s": 9.5}
    assert "first decision: switchMode at step 38, 6.2s after training began" in summary_lines(report)
    # Every other field is still there, the decisions and the training start included.
    plain = build_report(docs, job="j", mode="sync", expected_workers=1, emulation=None)
    assert set(report) == set(plain) | {"decisions", "training_start_s", "first_decision"}
    assert report["decisions"] == decisions and report["training_start_s"] == 3.25
    # No worker dated its start (an older trainer): the step and the run's clock only.
    undated = build_report(
        docs, job="j", mode="sync", expected_workers=1, emulation=None, extra={"decisions": decisions}
    )
    assert undated["first_decision"]["time_s"] is None and undated["first_decision"]["run_time_s"] == 9.5
    # An auto run that decided nothing says so.
    none = build_report(docs, job="j", mode="auto", expected_workers=1, emulation=None, extra={"decisions": []})
    assert none["first_decision"] is None


def test_the_auto_controller_dates_the_training_start_in_the_runs_clock() -> None:
    # The run began 4 s before training (process start-up); the first poll comes 10 s into training.
    scrapes = feed([STRAGGLER] * 6)[1:]
    frame = {t: ProgressFrame(time=1000.0 + t, elapsed_s=4.0 + t) for t, _ in scrapes}
    dated = [(t, [dataclasses.replace(s, time=1000.0 + t, training_seconds=t) for s in ss]) for t, ss in scrapes]
    assert training_start(dated[0][1], frame[dated[0][0]]) == 4.0
    assert training_start(scrapes[0][1], frame[scrapes[0][0]]) is None
    spec = spec_for(policy={"allowedActions": ["rebalance"], "persistenceIntervals": 2})
    clock = [0.0]
    auto = AutoController(SGDJob(spec=spec), PlainDisplay(stream=io.StringIO()), clock=lambda: clock[0])
    run = FakeRun()
    for t, samples in dated:
        clock[0] = 1000.0 + t
        results = [ScrapeResult(Endpoint(f"http://127.0.0.1:{9000 + s.rank}"), s.time, s, None) for s in samples]
        asyncio.run(auto(run, results, frame[t]))
    assert run.report_extra["training_start_s"] == 4.0
    report = build_report([], job="j", mode="sync", expected_workers=4, emulation=None, extra=run.report_extra)
    assert report["first_decision"]["time_s"] == 2 * INTERVAL and report["first_decision"]["action"] == "rebalance"


def test_mode_timeline_always_starts_with_the_start_mode() -> None:
    switches = [
        {"timeS": 9.0, "step": 120, "mode": "sync", "reason": "back"},
        {"timeS": 4.0, "step": 50, "mode": "async", "reason": "rank 3 slow"},
    ]
    assert mode_timeline(switches, "sync") == [
        {"time_s": 0.0, "step": 0, "mode": "sync", "reason": "start"},
        {"time_s": 4.0, "step": 50, "mode": "async", "reason": "rank 3 slow"},
        {"time_s": 9.0, "step": 120, "mode": "sync", "reason": "back"},
    ]
    assert mode_timeline(None, "hierarchical")[0]["mode"] == "hierarchical"
    started = [{"timeS": 0.1, "step": 0, "mode": "sync", "reason": "initial mode"}]
    assert mode_timeline(started, "sync") == [{"time_s": 0.1, "step": 0, "mode": "sync", "reason": "initial mode"}]


def status_result(rank: int, samples: int, compute: float, **kw: Any) -> ScrapeResult:
    status = {"rank": rank, "node": f"local-{rank}", "step": samples // 32, "samples": samples,
              "computeSeconds": compute, "commWaitSeconds": 0.0, "loss": 1.0 + rank, "mode": "sync",
              "done": False}  # fmt: skip
    status.update(kw)
    return ScrapeResult(Endpoint(f"http://127.0.0.1:{9400 + rank}"), 0.0, status=WorkerStatus.model_validate(status))


def test_summarize_rates_and_keeps_workers_that_stop_answering() -> None:
    first = summarize([status_result(0, 320, 1.0), status_result(1, 320, 3.0)], now=100.0, start=90.0)
    assert first.samples_per_s is None and first.step == 10 and first.elapsed_s == 10.0
    assert first.bound_per_s == pytest.approx(320 + 320 / 3)
    assert first.loss == pytest.approx(1.5) and first.mode == "sync" and first.reachable == 2
    split = summarize(
        [status_result(0, 320, 1.0, batchSize=40), status_result(1, 320, 3.0, batchSize=24)], now=100.0, start=90.0
    )
    assert (split.mode, split.mode_shown, first.mode_shown) == ("sync", "sync (rebalanced)", "sync")
    gone = ScrapeResult(Endpoint("http://127.0.0.1:9401"), 0.0, error="timed out")
    second = summarize([status_result(0, 960, 3.0, mode="async"), gone], now=102.0, start=90.0, previous=first)
    assert second.samples_per_s == pytest.approx((960 + 320 - 640) / 2.0)
    assert second.reachable == 1 and len(second.workers) == 2 and second.mode == "async"
    assert second.errors == ("http://127.0.0.1:9401: timed out",)


def test_plain_display_throttles_progress_lines() -> None:
    out = io.StringIO()
    display = PlainDisplay(out, every_s=5.0)
    display.start(RunInfo(job="q", mode="sync", nodes=2, workers=2, steps=100, out_dir="/tmp/x", notes=("heads up",)))
    for t in (100.0, 101.0, 106.0, 112.0):  # 101 is too soon; 112 repeats 106's figures
        display.update(summarize([status_result(0, min(int(t), 106) * 32, 1.0)], now=t, start=90.0))
    display.finish(None, "done")
    lines = out.getvalue().splitlines()
    assert lines[0] == "note: heads up"
    assert sum("step" in line and "samples/s" in line for line in lines) == 2
    assert lines[-1] == "done"


def test_a_command_mode_start_line_names_the_command_not_the_steps() -> None:
    """training.steps is not passed to a user's script: the start line must not promise it."""
    from rich.console import Console

    from sgdjob_operator.local.live import RichDisplay

    command = ("python", "train.py", "--epochs", "8", "--note", "a [b]")
    info = RunInfo(job="q", mode="command", nodes=2, workers=2, steps=1000, out_dir="/tmp/x", command=command)
    plain = io.StringIO()
    PlainDisplay(plain).start(info)
    rich_out = io.StringIO()
    rich = RichDisplay(Console(file=rich_out, width=200))
    rich.start(info)
    rich.finish(None, "done")
    for text in (plain.getvalue(), rich_out.getvalue()):
        start_line = next(line for line in text.splitlines() if line.startswith("sgdjob run q"))
        assert start_line.endswith("mode command, command: python train.py --epochs 8 --note 'a [b]'"), start_line
        assert "1000" not in start_line


def test_plain_display_counts_the_workers_of_the_current_world() -> None:
    out = io.StringIO()
    display = PlainDisplay(out, every_s=0.0)
    display.start(RunInfo(job="q", mode="auto", nodes=4, workers=4, steps=100, out_dir="/tmp/x"))
    display.update(summarize([status_result(0, 320, 1.0)], now=100.0, start=90.0))
    display.resize(3, 3)  # a rescale dropped a node
    display.update(summarize([status_result(0, 640, 1.0)], now=101.0, start=90.0))
    progress = [line for line in out.getvalue().splitlines() if "samples/s" in line]
    assert "workers 1/4  ETA" in progress[0] and "workers 1/3  ETA" in progress[1], progress


def job(mode: str = "auto", **spec: Any) -> Any:
    training = {"steps": 50, "emulation": {"computeSeconds": 0.01}, "checkpoint": {"dir": "/tmp/ignored"}}
    base = {"replicas": 3, "minReplicas": 2, "maxReplicas": 4, "nprocPerNode": 2, "mode": mode, "training": training}
    base.update(spec)
    return validate_job(
        {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "tiny"}, "spec": base}
    )


def test_resolve_mode_prefers_the_flag_and_starts_auto_synchronous() -> None:
    assert resolve_mode(JobMode.AUTO, "async") == (SyncMode.ASYNC, False)
    assert resolve_mode(JobMode.HIERARCHICAL, None) == (SyncMode.HIERARCHICAL, False)
    assert resolve_mode(JobMode.AUTO, None) == (SyncMode.SYNC, True)
    assert resolve_mode(JobMode.SYNC, "auto") == (SyncMode.SYNC, True)


def test_plan_launch_builds_one_torchrun_agent_per_node(tmp_path: Path) -> None:
    plan = plan_launch(job(), SyncMode.HIERARCHICAL, tmp_path, rdzv_port=29555, metrics_bases=[30000, 30010, 30020],
                       token="tok", python="/py",
                       base_env={"PATH": "/bin", "OMP_NUM_THREADS": "2", "SGDJOB_METRICS_PORT": "1"})  # fmt: skip
    assert plan.world_size == 6 and [a.node for a in plan.agents] == ["local-0", "local-1", "local-2"]
    a0, a1, _ = plan.agents
    assert a0.argv[:3] == ("/py", "-m", "sgdjob_trainer.agent")
    assert a0.argv[-4:] == ("-m", "sgdjob_trainer", "--config", str(tmp_path / "run-config-local-0.json"))
    for flag in (
        "--nnodes=2:4",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29555",
        "--rdzv-id=tiny",
    ):
        assert flag in a0.argv and flag in a1.argv
    # A fixed mode: torchrun retries backoffLimit (3) failures.
    assert "--max-restarts=3" in a0.argv
    # No agent hosts the rendezvous: the store is a process of its own, so any agent can leave.
    conf = "--rdzv-conf=is_host=0,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    assert conf in a0.argv and conf in a1.argv
    assert plan.store.argv == ("/py", "-m", "sgdjob_trainer.rendezvous_store", "--host", "127.0.0.1", "--port", "29555")
    assert a1.metrics_ports == (30010, 30011)
    assert a1.env["NODE_NAME"] == "local-1" and a1.env["SGDJOB_CONTROL_TOKEN"] == "tok" and a1.env["PATH"] == "/bin"
    assert a1.env["SGDJOB_REPORT_DIR"] == str(tmp_path / "ranks") and a1.env["OMP_NUM_THREADS"] == "2"
    assert "SGDJOB_METRICS_PORT" not in a1.env
    cfg = RunConfig.model_validate_json(a1.run_config.model_dump_json(by_alias=True))
    assert cfg.mode is SyncMode.HIERARCHICAL and cfg.job_name == "tiny" and cfg.reference_world_size == 4
    assert cfg.training.metrics_port == 30010 and cfg.training.steps == 50
    assert (
        cfg.training.checkpoint.dir == str(tmp_path / "checkpoints") and plan.checkpoint_dir == tmp_path / "checkpoints"
    )
    assert any("checkpoints go to" in n for n in plan.notes)
    with pytest.raises(ValueError, match="need 3"):
        plan_launch(job(), SyncMode.SYNC, tmp_path, rdzv_port=1, metrics_bases=[1], token="t", python="p", base_env={})


def test_an_auto_run_that_may_replace_workers_budgets_a_restart_per_leaving_member(tmp_path: Path) -> None:
    def restarts(mode: SyncMode, actions: list[str], auto: bool) -> str:
        j = job(policy={"allowedActions": actions})
        plan = plan_launch(
            j, mode, tmp_path, rdzv_port=1, metrics_bases=[1, 3, 5], token="t", python="p", base_env={}, auto=auto
        )
        return next(a for a in plan.agents[0].argv if a.startswith("--max-restarts="))

    # backoffLimit (3) plus maxReplicas (4): each departure ends the survivors' round once.
    assert restarts(SyncMode.SYNC, ["switchMode", "replaceWorker"], auto=True) == "--max-restarts=7"
    assert restarts(SyncMode.SYNC, ["switchMode", "rescale"], auto=True) == "--max-restarts=7"
    assert restarts(SyncMode.SYNC, ["switchMode", "rebalance"], auto=True) == "--max-restarts=3"
    assert restarts(SyncMode.SYNC, ["replaceWorker"], auto=False) == "--max-restarts=3"


def test_free_port_blocks_are_distinct_bindable_and_never_ephemeral() -> None:
    bases = free_port_blocks(3, size=2)
    ports = [b + i for b in bases for i in range(2)]
    assert len(set(ports)) == 6
    # the kernel gives connect() and bind(0) ports from this range, so none of ours may be in it
    low, high = ephemeral_ports()
    assert all(PORT_FLOOR <= p < low for p in ports), (ports, low, high)
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            socks.append(s)
    finally:
        for s in socks:
            s.close()


def test_ranks_without_a_file_fall_back_to_their_last_status() -> None:
    files = [rank_doc(0, 320, 1.0, 0.5, 2.0)]
    late = WorkerStatus(
        rank=1,
        node="local-1",
        samples=160,
        compute_seconds=2.0,
        step=5,
        loss=0.75,
        time=1003.0,
        start_time=1000.0,
    )
    statuses = {0: WorkerStatus(rank=0, samples=1), 1: late}
    docs = with_status_fallback(files, statuses)
    assert (
        docs[0] == files[0] and docs[1]["fromStatus"] and docs[1]["wallSeconds"] == 3.0 and docs[1]["finalLoss"] == 0.75
    )
    report = build_report(docs, job="j", mode="sync", expected_workers=2, emulation=None)
    assert report["ranks_from_last_status"] == [1] and report["missing_ranks"] == [] and report["samples"] == 480
    assert report["wall_s"] == 3.0 and report["per_rank"][1]["speed_samples_per_s"] == 80.0


def test_report_has_the_validation_curve_and_the_time_to_target() -> None:
    # Rows of an older trainer have no sixth (metric) column.
    history = [[0, 2.3, 0.1, 0.0, 0], [50, 0.9, 0.7, 2.5, 1600, 0.3], [100, 0.4, 0.93, 5.0, 3200, None]]
    control = rank_doc(0, 3200, 10.0, 1.0, 6.0, validationHistory=history, validationLoss=0.4,
                       validationAccuracy=0.93, validationStep=100, endReason="TargetReached",
                       timeToTargetS=5.0, targetStep=100)  # fmt: skip
    report = build_report([rank_doc(1, 1600, 10.0, 1.0, 6.0), control], job="j", mode="sync",
                          expected_workers=2, emulation=None)  # fmt: skip
    # Samples on the curve are the job's: rank 0's own scaled by its share (3200 of 4800) at the end.
    assert report["validation_curve"] == [
        {"step": 0, "time_s": 0.0, "samples": 0, "loss": 2.3, "accuracy": 0.1, "metric": None},
        {"step": 50, "time_s": 2.5, "samples": 2400, "loss": 0.9, "accuracy": 0.7, "metric": 0.3},
        {"step": 100, "time_s": 5.0, "samples": 4800, "loss": 0.4, "accuracy": 0.93, "metric": None},
    ]
    assert report["validation"] == {"step": 100, "loss": 0.4, "accuracy": 0.93, "metric": None}
    assert (report["reason"], report["time_to_target_s"], report["target_step"]) == ("TargetReached", 5.0, 100)
    lines = summary_lines(report)
    assert any("accuracy 0.930" in line for line in lines) and any(
        "target reached at step 100" in line for line in lines
    )
    plain = build_report([rank_doc(0, 10, 1.0, 0.0, 1.0)], job="j", mode="sync", expected_workers=1, emulation=None)
    assert plain["validation_curve"] == [] and plain["reason"] is None and plain["time_to_target_s"] is None


def test_a_shrunk_runs_report_counts_the_last_world_only() -> None:
    # A rescale from 3 to 2: ranks 0 and 1 rewrote their files in the world of 2, rank 2's is the old world's.
    docs = [
        {"rank": 0, "worldSize": 2, "steps": 600},
        {"rank": 1, "worldSize": 2, "steps": 600},
        {"rank": 2, "worldSize": 3, "steps": 18},
    ]
    kept, world = final_world(docs)
    assert world == 2 and [d["rank"] for d in kept] == [0, 1]
    # Rank 0's file missing (it never wrote one): nothing is dropped and the size is not known.
    assert final_world(docs[1:]) == (docs[1:], None)
