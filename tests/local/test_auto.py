"""`sgdjob run` in auto mode: the policy core drives real trainer processes on this machine."""

from __future__ import annotations

import pytest

from sgdjob_operator.api.validation import validate_job
from sgdjob_operator.local.auto import applied_epoch
from sgdjob_operator.local.runner import poll_seconds
from sgdjob_operator.workers.scrape import Endpoint, ScrapeResult
from sgdjob_trainer.wire.worker_status import WorkerStatus
from tests.local.example_runs import RunExample, processes_mentioning


def test_applied_epoch_is_what_rank_0_reports() -> None:
    ep = Endpoint("http://127.0.0.1:1")
    assert applied_epoch([ScrapeResult(ep, 0.0, None, WorkerStatus(rank=1, control_epoch=5), None)]) is None
    assert applied_epoch([ScrapeResult(ep, 0.0, None, WorkerStatus(rank=0, control_epoch=2), None)]) == 2


def test_an_auto_run_polls_at_least_once_per_policy_interval() -> None:
    doc = {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "p"},
           "spec": {"replicas": 2, "mode": "auto", "policy": {"intervalSeconds": 0.5}}}  # fmt: skip
    job = validate_job(doc)
    assert poll_seconds(1.0, job, auto=True) == 0.5  # the policy's windows stay 0.5 s long
    assert poll_seconds(0.2, job, auto=True) == 0.2
    assert poll_seconds(1.0, job, auto=False) == 1.0  # no policy: the requested pace


@pytest.mark.multiproc
def test_quickstart_adapts_to_the_straggler_with_a_measured_reason_and_writes_plots(run_example: RunExample) -> None:
    # 300 steps: enough for the policy to act; keeps the tier short.
    code, output, report, out = run_example("quickstart.yaml", {"training": {"steps": 300}})
    assert code == 0 and report is not None, output
    assert processes_mentioning(str(out)) == [], "processes of the run are left behind"
    assert report["ok"] and report["mode"] == "auto" and report["missing_ranks"] == []
    changes = [d for d in report["decisions"] if d["action"] in ("switchMode", "rebalance")]
    assert changes and "rank 3" in changes[0]["reason"], report["decisions"]
    change = changes[0]
    # The trainers measured their gradients before the policy chose a stale mode: the worth of a
    # stale or damped sample was measured, not assumed. (A new split of sync's batch keeps every
    # gradient fresh and the global batch whole; a 3x straggler's is made on its first window.)
    stale = [d for d in changes if d["action"] == "switchMode" and d.get("mode") in ("async", "hierarchical")]
    assert all("statistical efficiency measured" in d["reason"] for d in stale), stale
    at_once = [d for d in changes if "made at once" in d["reason"]]
    assert all(d["action"] == "rebalance" and d["predictedGain"] >= 1.0 for d in at_once), at_once
    if change["action"] == "switchMode":
        assert f"switch to {change['mode']}" in output
        assert [e["mode"] for e in report["mode_timeline"]][:2] == ["sync", change["mode"]]
    else:
        assert f"decision at step {change['step']}: rebalance" in output
        batches = {r["rank"]: r["batch_size"] for r in report["per_rank"]}
        assert batches[3] < batches[0], f"the slow rank ends with the smaller batch: {batches}"
    assert report["final_loss"] < report["initial_loss"]
    for name in ("step_times.png", "loss.png", "throughput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = report["first_decision"]
    assert first is not None and first["time_s"] is not None, "the real trainer dates its training start"
    assert (first["step"], first["action"]) == (report["decisions"][0]["step"], report["decisions"][0]["action"])
    print(
        f"quickstart (300 steps) auto: efficiency {report['efficiency']:.2f}, changes {len(changes)}, "
        f"first decision at step {first['step']}, {first['time_s']:.1f} s after training began"
    )
