"""`sgdjob run` in auto mode changes who runs: a node-bound straggler is replaced by a worker on a
new node, or dropped by a rescale within min/max; the survivors resume from the checkpoint the
leaving worker helped write. Real torchrun agents and trainers on loopback."""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

import pytest

from tests.local.example_runs import RunExample, processes_mentioning

pytestmark = pytest.mark.multiproc


def run_with(run_example: RunExample, actions: list[str]) -> tuple[dict[str, Any], str, Path]:
    code, output, report, out = run_example(
        "node-straggler.yaml", {"training": {"steps": 200}, "policy": {"allowedActions": actions}}
    )
    assert code == 0 and report is not None, output
    assert processes_mentioning(str(out)) == [], "processes of the run are left behind"
    return report, output, out


def test_a_node_bound_straggler_is_replaced_by_a_worker_on_a_new_node(run_example: RunExample) -> None:
    report, output, _ = run_with(run_example, ["replaceWorker"])
    assert report["ok"] and report["steps"] == 200 and report["missing_ranks"] == [], report
    replace = [d for d in report["decisions"] if d["action"] == "replaceWorker"]
    assert replace and replace[0]["applied"] and "local-3" in replace[0]["reason"], report["decisions"]
    assert "decision at step" in output and "replaceWorker" in output
    change = report["membership"][0]
    assert change["retired"] == ["local-3"] and change["added"] == ["local-4"], report["membership"]
    assert sorted(r["node"] for r in report["per_rank"]) == ["local-0", "local-1", "local-2", "local-4"]
    # One restart, or two when the new agent joins after the survivors' round closed (torchrun's last
    # call); either way the stop was agreed, so no step is redone.
    assert report["restarts"] >= 1 and report["lost_steps"] <= 1, report["resumes"]
    # The slow machine is gone: after the change every worker runs at the healthy speed.
    speeds = [r["speed_samples_per_s"] for r in report["per_rank"]]
    assert max(speeds) < 1.3 * min(speeds), speeds
    assert report["final_loss"] < report["initial_loss"]
    print(
        f"replace: efficiency {report['efficiency']:.2f} after the change, replaced at {change['time_s']:.1f}s, "
        f"restart {report['resumes'][0]['restartSeconds']:.1f}s"
    )


def test_rescale_drops_the_straggler_and_finishes_with_fewer_workers(run_example: RunExample) -> None:
    report, _, out = run_with(run_example, ["rescale"])
    assert report["ok"] and report["steps"] == 200, report
    rescale = [d for d in report["decisions"] if d["action"] == "rescale"]
    assert rescale and rescale[0]["applied"] and rescale[0]["replicas"] == 3, report["decisions"]
    change = report["membership"][0]
    assert (
        change["retired"] == ["local-3"]
        and change["added"] == []
        and change["nodes"] == ["local-0", "local-1", "local-2"]
    )
    assert report["workers"] == report["expected_workers"] == 3 and report["missing_ranks"] == []
    assert sorted(r["node"] for r in report["per_rank"]) == ["local-0", "local-1", "local-2"]
    speeds = [r["speed_samples_per_s"] for r in report["per_rank"]]
    assert max(speeds) < 1.3 * median(speeds), speeds
    assert report["final_loss"] < report["initial_loss"]
    # The run measured its launch, then the rescale as a shrink of its own (what the next one is weighed
    # by), from the decision on: the survivors may train again before the retired agent has exited.
    measured = report["restarts_measured"]
    assert [m["from"] for m in measured] == ["launch", "shrink"], measured
    change_took = measured[1]
    assert 1.0 <= change_took["seconds"] < 120.0
    # The runner named the retired agent to the store: a survivor dropped it without its heartbeats.
    survivors = "".join((out / "logs" / f"local-{i}.log").read_text() for i in range(3))
    assert "was removed by the job's controller: off the rendezvous" in survivors, survivors[-3000:]


def test_a_hung_worker_is_replaced_and_the_job_finishes_from_the_checkpoint(run_example: RunExample) -> None:
    """Rank 2 blocks for good inside its compute at step 40 (an emulated wedged GPU): the others wait
    in the allreduce. The policy names rank 2 as hung once it has made no step for
    hangTimeoutSeconds, its worker is replaced, and the job finishes every step from a checkpoint."""
    code, output, report, out = run_example(
        "node-straggler.yaml",
        {
            "training": {
                "steps": 120,
                "checkpoint": {"intervalSteps": 20},
                "emulation": {"slowdowns": []},
                "faults": [{"kind": "hang", "rank": 2, "atStep": 40}],
            },
            "policy": {"intervalSeconds": 1, "hangTimeoutSeconds": 6, "allowedActions": ["replaceWorker"]},
        },
    )
    assert code == 0 and report is not None, output
    assert processes_mentioning(str(out)) == [], "processes of the run are left behind"
    assert report["ok"] and report["steps"] == 120, report
    hangs = [d for d in report["decisions"] if d["action"] == "replaceWorker" and "hang" in d["reason"]]
    assert hangs and hangs[0]["rank"] == 2 and hangs[0]["applied"], report["decisions"]
    assert "stuck in its own compute" in hangs[0]["reason"]
    assert len(hangs) == 1, "one recovery: the replacement does not hang"
    assert report["restarts"] >= 1 and report["resumes"][0]["fromStep"] == 40, report["resumes"]
    print(f"hang: replaced at {hangs[0]['time_s']:.1f}s, restart {report['resumes'][0]['restartSeconds']:.1f}s")
