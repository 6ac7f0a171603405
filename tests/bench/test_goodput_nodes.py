"""The real-node goodput benchmark's pure parts (bench/goodput_nodes.py): every system's SGDJob is one
the operator accepts, with no emulation, one worker per node, ddp-drop off the slow node and lb-bsp's
split from step 0 in proportion to the nodes' CPUs; and the issue's targets scored on the medians."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.goodput import TASKS
from bench.goodput_nodes import (
    SYSTEMS,
    Fleet,
    ddp_config,
    job_manifest,
    keep_logs,
    keep_run_logs,
    lb_landed,
    lb_split,
    node_checks,
)
from sgdjob_operator.api.validation import validate_spec

CFG = TASKS["digits-cnn"].config
SLOW = Fleet((0.8, 0.8, 0.27), ("node-1", "node-2", "node-3"))
EQUAL = Fleet((0.6, 0.6, 0.6), ("node-1", "node-2", "node-3"))


def test_every_systems_job_is_valid_real_compute_and_one_worker_per_node(tmp_path: Path) -> None:
    for system in SYSTEMS:
        doc = job_manifest(CFG, SLOW, system, f"{system}-s100", tmp_path)
        spec = validate_spec(doc["spec"])  # what the operator's webhook and admission run
        pod = doc["spec"]["template"]["spec"]
        assert "emulation" not in doc["spec"]["training"], system
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname", system
        assert anti["labelSelector"]["matchLabels"]["sgdjob.dev/job-name"] == f"{system}-s100"
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert str(tmp_path) in mounts, system
        if system == "ddp-drop":
            assert spec.replicas == 2
            [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"
            ]
            assert term["matchExpressions"][0]["values"] == ["node-3"]
        else:
            assert spec.replicas == 3 and "nodeAffinity" not in pod["affinity"], system
        if system.startswith("ddp"):
            assert doc["spec"]["training"]["command"][:3] == ["python", "-m", "bench.ddp_baseline"]
        else:
            assert doc["spec"]["training"]["batchSize"] == CFG.batch_size


def test_auto_default_runs_at_the_shipping_interval_and_auto_at_the_benchmarks(tmp_path: Path) -> None:
    from sgdjob_operator.api.models import PolicySpec

    auto = job_manifest(CFG, SLOW, "auto", "a", tmp_path)["spec"]["policy"]["intervalSeconds"]
    default = job_manifest(CFG, SLOW, "auto-default", "b", tmp_path)["spec"]["policy"]["intervalSeconds"]
    assert auto == CFG.policy["intervalSeconds"] and default == PolicySpec().interval_seconds != auto


def test_lb_bsp_is_static_and_the_autos_may_act(tmp_path: Path) -> None:
    actions = {
        s: job_manifest(CFG, SLOW, s, s, tmp_path)["spec"].get("policy", {}).get("allowedActions") for s in SYSTEMS
    }
    assert actions["lb-bsp"] == [] and actions["auto"] and actions["auto-default"]
    # The autos are elastic jobs: the policy may drop the slow node as ddp-drop does by hand.
    for auto in ("auto", "auto-default"):
        spec = job_manifest(CFG, SLOW, auto, auto, tmp_path)["spec"]
        assert "rescale" in actions[auto] and spec["minReplicas"] == spec["replicas"] - 1
        assert spec["training"]["checkpoint"]["dir"].startswith(str(tmp_path))  # shared by every node


def test_lb_bsp_split_follows_the_cpus_and_is_checked_against_where_it_ran() -> None:
    split = lb_split(CFG, SLOW)
    assert sum(split) == 3 * CFG.batch_size and split[0] == split[1] > 2.5 * split[2]
    docs: list[dict[str, Any]] = [{"rank": r, "node": f"node-{r + 1}"} for r in range(3)]
    assert lb_landed(split, docs, "node-3") is None
    docs[2]["node"], docs[0]["node"] = "node-1", "node-3"
    assert "ran on node-1, not node-3" in str(lb_landed(split, docs, "node-3"))


def test_ddp_drop_trains_on_two_with_the_full_fleets_learning_rate_scaled() -> None:
    full, drop = ddp_config(CFG, SLOW, "ddp"), ddp_config(CFG, SLOW, "ddp-drop")
    assert "emulation" not in full["training"] and "emulation" not in drop["training"]
    assert full["referenceWorldSize"] == 3 and drop["referenceWorldSize"] == 3


def test_an_equal_fleet_runs_ddp_and_the_autos_only() -> None:
    assert EQUAL.systems(SYSTEMS) == ["ddp", "auto", "auto-default"] and SLOW.slowest == 2


def _system(times: list[float | None], accuracy: float) -> dict[str, Any]:
    runs = [{"time_to_target_s": t, "accuracy_at_budget": accuracy} for t in times]
    finite = sorted(t for t in times if t is not None)
    return {
        "time_to_target_s": {"median": finite[len(finite) // 2] if finite else None},
        "accuracy_at_budget": {"median": accuracy},
        "runs": runs,
    }


def test_targets_are_scored_on_the_medians_per_fleet() -> None:
    slow = {
        "scenario": SLOW.name,
        "equal": False,
        "systems": {
            "ddp": _system([30.0, 31.0, 29.0], 0.90),
            "ddp-drop": _system([20.0, 21.0, 19.0], 0.90),
            "lb-bsp": _system([16.0, 15.0, 17.0], 0.91),
            "auto": _system([16.0, 17.0, 15.0], 0.92),
        },
    }
    equal = {
        "scenario": EQUAL.name,
        "equal": True,
        "systems": {"ddp": _system([10.0] * 3, 0.9), "auto": _system([10.5] * 3, 0.9)},
    }
    checks = {(c.scenario, c.target): c for c in node_checks([slow, equal]) if c.system == "auto"}
    assert checks[(SLOW.name, "slow node: <= 0.6x DDP")].met  # 16 / 30 = 0.53
    assert checks[(SLOW.name, "slow node: <= 1.0x best other")].met  # 16 / lb-bsp's 16
    assert "lb-bsp" in checks[(SLOW.name, "slow node: <= 1.0x best other")].figure
    assert checks[(SLOW.name, "accuracy at budget >= DDP - 0.5 points")].met
    assert not checks[(EQUAL.name, "equal fleet: <= 1.02x DDP")].met  # 10.5 / 10 = 1.05
    assert all(c.binding == (c.system == "auto") for c in node_checks([slow, equal]))


def test_a_runs_pod_logs_are_kept_one_file_per_pod_container_and_life(tmp_path: Path) -> None:
    """After a run, each life of each container can be read by name (a restart is a second file)."""
    base = "/x/node-1/log/pods/goodput_auto-s100-worker-0_0b1c-uid"
    logs = {f"{base}/trainer/0.log": "first life\n", f"{base}/trainer/1.log": "second life\n"}
    keep_logs(logs, tmp_path / "logs")
    kept = {f.name: f.read_text() for f in (tmp_path / "logs").iterdir()}
    assert kept == {
        "auto-s100-worker-0.trainer.0.log": "first life\n",
        "auto-s100-worker-0.trainer.1.log": "second life\n",
    }


def test_the_operators_lines_about_the_run_are_kept_beside_its_pods_logs(tmp_path: Path) -> None:
    """What the policy said of this job (every pass's reason with --operator-verbose), in time order
    across the operator's replicas, and nothing of other jobs."""
    pods = {"/x/node-1/log/pods/goodput_auto-s100-worker-0_u/trainer/0.log": "trained\n"}
    operators = {
        "/x/node-0/log/pods/sgdjob-system_sgdjob-operator-a_u/operator/0.log": (
            "2026-12-06T03:00:02Z [DEBUG] goodput/auto-s100: keep: persisting 1/2 intervals\n"
            "2026-12-06T03:00:01Z [INFO] goodput/auto-s1000: keep: another job\n"
        ),
        "/x/node-3/log/pods/sgdjob-system_sgdjob-operator-b_u/operator/0.log": (
            "2026-12-06T03:00:01Z [INFO] goodput/auto-s100 rescale to 2: single straggler\n"
        ),
    }

    def logs(namespace: str, prefix: str) -> dict[str, str]:
        found = pods if namespace == "goodput" else operators
        return {p: t for p, t in found.items() if f"/{namespace}_{prefix}" in p}

    keep_run_logs(logs, "auto-s100", tmp_path / "logs")
    assert (tmp_path / "logs" / "auto-s100-worker-0.trainer.0.log").read_text() == "trained\n"
    assert (tmp_path / "logs" / "operator.log").read_text().splitlines() == [
        "2026-12-06T03:00:01Z [INFO] goodput/auto-s100 rescale to 2: single straggler",
        "2026-12-06T03:00:02Z [DEBUG] goodput/auto-s100: keep: persisting 1/2 intervals",
    ]


def test_a_task_with_its_own_code_has_it_on_every_systems_workers(tmp_path: Path) -> None:
    """charlm's code lives in examples/custom-task, not in the trainer image: without its folder on the
    workers' PYTHONPATH the DDP script crashed at import (every system of the local benchmark has it)."""
    charlm = TASKS["charlm"].config
    for system in SYSTEMS:
        pod = job_manifest(charlm, SLOW, system, f"{system}-s100", tmp_path)["spec"]["template"]["spec"]
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        paths = env["PYTHONPATH"].split(":")
        assert paths[0].endswith("examples/custom-task"), system
        mounted = {v["hostPath"]["path"] for v in pod["volumes"]}
        assert all(any(p.startswith(m) for m in mounted) for p in paths), system
    digits = job_manifest(CFG, SLOW, "auto", "a", tmp_path)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "PYTHONPATH" not in {e["name"] for e in digits}, "the digits task is in the trainer image"
