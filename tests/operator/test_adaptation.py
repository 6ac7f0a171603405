"""Workers of emulated speeds drive the operator's policy loop: each is the trainer's own Telemetry and
TrainerServer on a loopback address set as its pod's podIP (trainer_fleet.py), rank 0's taking POST
/control with the job's token; only their compute is emulated."""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from typing import Any

import pytest

from tests.operator.conftest import Cluster, Operator, wait_for
from tests.operator.trainer_fleet import BATCH, Fleet

pytestmark = pytest.mark.k8s


def _free_port(hosts: list[str]) -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every address")


def _start(cluster: Cluster, name: str, spec: dict[str, Any], speeds: list[float], subnet: int) -> Fleet:
    """Apply the job, start one real trainer endpoint per worker on its own loopback address, and
    report the pods Running at those addresses (the kubelet's part)."""
    hosts = [f"127.0.{subnet}.{i + 2}" for i in range(len(speeds))]
    port = _free_port(hosts)
    # The workers step until stopped: a job far from its last step, so no change is held back for
    # want of time to repay it.
    training = {"steps": 1_000_000, **spec.get("training", {}), "metricsPort": port, "batchSize": BATCH}
    cluster.apply(name, {**spec, "replicas": len(speeds), "training": training})
    fleet = Fleet(hosts, port, speeds, _token(cluster, name))
    wait_for(f"{len(speeds)} pods", lambda: len(cluster.pods(name)) == len(speeds))
    for i, host in enumerate(hosts):
        cluster.run_pod(f"{name}-worker-{i}", host, node=f"node-{i}")
    return fleet


def _token(cluster: Cluster, name: str) -> str:
    """The job's control token, as its pods' env gives it to the trainer."""
    secret = wait_for("token", lambda: cluster.core.read_namespaced_secret(f"{name}-control", cluster.ns).data)
    return base64.b64decode(secret["token"]).decode()


# A quick mode-switch policy (also used by test_leader_election's failover-mid-switch case).
SWITCH_POLICY = {
    "intervalSeconds": 1,
    "persistenceIntervals": 2,
    "cooldownSeconds": 0,
    "switchMargin": 0.1,
    "allowedActions": ["switchMode"],
}


def test_simulated_straggler_drives_a_mode_switch(cluster: Cluster, operator: Operator) -> None:
    fleet = _start(
        cluster, "adapt", {"mode": "auto", "policy": SWITCH_POLICY}, [0.02, 0.02, 0.02, 0.06], subnet=20
    )  # rank 3 three times slower
    try:
        status = wait_for(
            "Running in sync with steps",
            lambda: (s := cluster.status("adapt")).get("mode") == "sync" and s.get("step", 0) > 0 and s,
        )
        assert status["phase"] == "Running"

        status = wait_for(
            "a switch decision",
            lambda: (s := cluster.status("adapt")).get("targetMode") not in (None, "sync") and s,
            timeout=90,
        )
        target = status["targetMode"]
        decision = status["decisions"][-1]
        assert decision["action"] == "switchMode" and decision["mode"] == target and decision["reason"]
        assert status["phase"] == "Adapting"  # workers still report sync
        event = wait_for("SwitchMode event", lambda: [e for e in cluster.events("adapt") if e.reason == "SwitchMode"])
        assert target in event[0].message

        # Level-triggered: the command is pushed with the job's token (rank 0's server checks it), and
        # again while unapplied.
        posts = wait_for("two pushes", lambda: len(fleet.offered) >= 2 and list(fleet.offered), timeout=30)
        body = posts[-1]
        assert body.mode is not None and body.mode.value == target and body.epoch >= 1
        assert {p.epoch for p in posts} == {body.epoch}

        # An operator restart mid-switch loses nothing: the decision and the command live in status.
        operator.kill()
        seen = len(fleet.offered)
        operator.start()
        wait_for("re-push after restart", lambda: len(fleet.offered) > seen, timeout=60)
        assert fleet.offered[-1].epoch == body.epoch and fleet.offered[-1].mode == body.mode
        assert cluster.status("adapt")["decisions"] == status["decisions"]

        applied = fleet.apply()  # the workers switch at a step boundary and report it
        assert applied is not None and (applied.epoch, applied.mode) == (body.epoch, body.mode)
        status = wait_for(
            "mode follows",
            lambda: (s := cluster.status("adapt")).get("mode") == target and s.get("phase") == "Running" and s,
        )
        assert status["targetMode"] == target
        wait_for("ModeSwitched event", lambda: "ModeSwitched" in cluster.reasons("adapt"))
        pushes, reads = len(fleet.offered), fleet.status_reads
        # Applied: the next passes (seen reading rank 0's /status) push nothing more.
        wait_for("three more monitor passes", lambda: fleet.status_reads >= reads + 3, timeout=30)
        assert len(fleet.offered) == pushes
        assert status["throughput"] and status["loss"] is not None
        run_config = json.loads(
            cluster.core.read_namespaced_config_map("adapt-config", cluster.ns).data["run-config.json"]
        )
        assert run_config["mode"] == target  # a restarted world starts in the new mode
    finally:
        fleet.stop()


def test_node_bound_straggler_is_replaced_off_its_node(cluster: Cluster, operator: Operator) -> None:
    # A replacement restarts the world (restartSeconds 60 in the cost model): it must repay that within
    # the cooldown, hence the long cooldown; minReplicas 3 lets training go on while it happens.
    policy = {
        "intervalSeconds": 1,
        "persistenceIntervals": 2,
        "cooldownSeconds": 120,
        "allowedActions": ["replaceWorker"],
    }
    fleet = _start(cluster, "swap", {"minReplicas": 3, "policy": policy}, [0.02, 0.02, 0.02, 0.06], subnet=21)
    try:
        old = cluster.pods("swap")["swap-worker-3"].metadata.uid
        status = wait_for(
            "replacement decided", lambda: (s := cluster.status("swap")).get("decisions") and s, timeout=90
        )
        decision = status["decisions"][-1]
        assert decision["action"] == "replaceWorker" and decision["rank"] == 3
        (excluded,) = status["controller"]["excludedNodes"]
        assert excluded["node"] == "node-3" and excluded["since"] and excluded["until"] > excluded["since"]
        new = wait_for(
            "worker 3 recreated",
            lambda: (p := cluster.pods("swap").get("swap-worker-3")) is not None and p.metadata.uid != old and p,
        )
        (term,) = (
            new.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        )
        assert [(f.key, f.operator, f.values) for f in term.match_fields] == [("metadata.name", "NotIn", ["node-3"])]
        assert all(
            p.spec.affinity is None for n, p in cluster.pods("swap").items() if n != "swap-worker-3"
        )  # only new pods carry it
        event = wait_for(
            "ReplaceWorker event", lambda: [e for e in cluster.events("swap") if e.reason == "ReplaceWorker"]
        )
        assert "node-3" in event[0].message
        assert len(cluster.status("swap")["decisions"]) == 1  # one change in flight: nothing else while it lands
    finally:
        fleet.stop()


def test_the_policy_goes_on_while_a_worker_waits_for_a_node(cluster: Cluster, operator: Operator) -> None:
    """A job of 4 (minReplicas 3) whose fourth pod no node fits (say its node was lost and is
    excluded): the three placed workers train, and the policy still rebalances their straggler.
    Held as a change in flight, it decided nothing until a node came."""
    policy = {"intervalSeconds": 1, "persistenceIntervals": 2, "cooldownSeconds": 2, "allowedActions": ["rebalance"]}
    speeds = [0.02, 0.02, 0.06]  # rank 2 three times slower
    hosts = [f"127.0.25.{i + 2}" for i in range(3)]
    port = _free_port(hosts)
    training = {"steps": 1_000_000, "metricsPort": port, "batchSize": BATCH}
    cluster.apply("wait", {"replicas": 4, "minReplicas": 3, "policy": policy, "training": training})
    fleet = Fleet(hosts, port, speeds, _token(cluster, "wait"))
    try:
        wait_for("4 pods", lambda: len(cluster.pods("wait")) == 4)
        for i, host in enumerate(hosts):
            cluster.run_pod(f"wait-worker-{i}", host, node=f"node-{i}")
        why = "0/3 nodes are available: 3 node(s) were taken, 1 node(s) not ready"
        cluster.refuse_pod("wait-worker-3", why)
        status = wait_for("a rebalance", lambda: (s := cluster.status("wait")).get("decisions") and s, timeout=60)
        decision = status["decisions"][-1]
        assert decision["action"] == "rebalance" and "rank 2" in decision["reason"], decision
        assert cluster.job("wait")["spec"]["replicas"] == 4, "a size a person set is not given back"
        adapting = next(c for c in status["conditions"] if c["type"] == "Adapting")
        assert adapting["reason"] == "WorkersUnschedulable" and why in adapting["message"]
    finally:
        fleet.stop()


def test_straggler_removed_by_rescale_within_bounds(cluster: Cluster, operator: Operator) -> None:
    policy = {"intervalSeconds": 1, "persistenceIntervals": 2, "cooldownSeconds": 120, "allowedActions": ["rescale"]}
    fleet = _start(
        cluster, "trim", {"minReplicas": 3, "maxReplicas": 4, "policy": policy}, [0.02, 0.02, 0.02, 0.06], subnet=22
    )
    try:
        status = wait_for("rescale decided", lambda: (s := cluster.status("trim")).get("decisions") and s, timeout=90)
        assert status["decisions"][-1]["action"] == "rescale" and status["decisions"][-1]["replicas"] == 3
        # The same knob `kubectl scale` turns; the operator writes status first (it names the pods
        # that go), then the scale, so the scale may land just after the decision shows.
        wait_for("spec.replicas 3", lambda: cluster.job("trim")["spec"]["replicas"] == 3, timeout=15)
        wait_for(
            "worker 3 removed", lambda: set(cluster.pods("trim")) == {"trim-worker-0", "trim-worker-1", "trim-worker-2"}
        )
        wait_for("Rescale event", lambda: "Rescale" in cluster.reasons("trim"))
        assert (
            wait_for("back to Running", lambda: (s := cluster.status("trim")).get("phase") == "Running" and s)["ready"]
            == "3/3"
        )
    finally:
        fleet.stop()


def test_rescale_removes_the_slow_ranks_pod_and_a_healthy_job_grows_back(cluster: Cluster, operator: Operator) -> None:
    policy = {"intervalSeconds": 1, "persistenceIntervals": 2, "cooldownSeconds": 5, "allowedActions": ["rescale"]}
    spec = {"minReplicas": 3, "maxReplicas": 4, "policy": policy}
    fleet = _start(cluster, "mid", spec, [0.02, 0.2, 0.02, 0.02], subnet=24)  # rank 1 ten times slower
    hosts = [f"127.0.24.{i + 2}" for i in range(4)]
    try:
        kept = {n: p.metadata.uid for n, p in cluster.pods("mid").items() if n != "mid-worker-1"}
        status = wait_for("rescale decided", lambda: (s := cluster.status("mid")).get("decisions") and s, timeout=90)
        assert status["decisions"][-1]["action"] == "rescale" and status["decisions"][-1]["replicas"] == 3
        assert status["controller"]["workerIndices"] == [0, 2, 3]
        assert [e["node"] for e in status["controller"]["excludedNodes"]] == ["node-1"]
        wait_for("spec.replicas 3", lambda: cluster.job("mid")["spec"]["replicas"] == 3, timeout=15)
        wait_for("the slow rank's pod removed", lambda: set(cluster.pods("mid")) == set(kept))
        event = wait_for("Rescale event", lambda: [e for e in cluster.events("mid") if e.reason == "Rescale"])
        assert "removing mid-worker-1" in event[0].message and "node node-1 excluded" in event[0].message

        # A restarted operator keeps the same three pods: no duplicate, no other pod removed.
        operator.kill()
        reads = fleet.status_reads
        operator.start()
        wait_for("the restarted operator's passes", lambda: fleet.status_reads >= reads + 3, timeout=30)
        assert {n: p.metadata.uid for n, p in cluster.pods("mid").items()} == kept

        # The world re-forms from the three pods left (ranks 0..2), all fast: the fleet is healthy,
        # so after the cooldown the policy grows the job back to the 4 replicas the user asked for.
        fleet.stop()
        kept_at = (0, 2, 3)
        nodes = [f"node-{i}" for i in kept_at]
        fleet = Fleet([hosts[i] for i in kept_at], fleet.port, [0.02] * 3, _token(cluster, "mid"), nodes)
        status = wait_for(
            "grown back", lambda: (s := cluster.status("mid"))["decisions"][-1]["replicas"] == 4 and s, timeout=90
        )
        decision = status["decisions"][-1]
        assert decision["action"] == "rescale" and "grow to 4 nodes" in decision["reason"]
        assert "workerIndices" not in status["controller"]
        # The status is written first, then the scale (k8s.reconcile): wait for the second write.
        wait_for("spec.replicas 4", lambda: cluster.job("mid")["spec"]["replicas"] == 4, timeout=15)
        new = wait_for("worker 1 recreated", lambda: cluster.pods("mid").get("mid-worker-1"))
        assert set(cluster.pods("mid")) == {f"mid-worker-{i}" for i in range(4)}
        (term,) = (
            new.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        )
        assert [(f.key, f.values) for f in term.match_fields] == [("metadata.name", ["node-1"])]  # still excluded
        grow = wait_for(
            "growth event", lambda: [e for e in cluster.events("mid") if "growing back" in (e.message or "")]
        )
        assert "rescaling 3 -> 4 workers" in grow[0].message

        # The scheduler finds no node for it (node-1 is excluded, the other nodes are taken): after a
        # cooldown (5 s) the growth is given back, and the job grows no more while node-1 is excluded.
        # Waiting instead held every later change of the policy for excludeNodeSeconds (an hour).
        why = "0/4 nodes are available: 3 node(s) were taken, 1 node(s) didn't match Pod's node affinity"
        cluster.refuse_pod("mid-worker-1", why)
        back = wait_for(
            "growth given back",
            lambda: [e for e in cluster.events("mid") if e.reason == "GrowthUnschedulable"],
            timeout=60,
        )
        assert "rescaling 4 -> 3 workers (giving back mid-worker-1)" in back[0].message and why in back[0].message
        wait_for("spec.replicas 3 again", lambda: cluster.job("mid")["spec"]["replicas"] == 3, timeout=15)
        wait_for("the unplaced pod removed", lambda: set(cluster.pods("mid")) == set(kept))
        status = cluster.status("mid")
        assert status["controller"]["workerIndices"] == [0, 2, 3]
        held = status["controller"]["growthHeldUntil"]
        assert held == status["controller"]["excludedNodes"][0]["until"], "held while node-1 is excluded"
        reads = fleet.status_reads  # rank 0 of the world of three counts the passes now
        wait_for("more passes", lambda: fleet.status_reads >= reads + 10, timeout=30)
        assert cluster.job("mid")["spec"]["replicas"] == 3 and cluster.status("mid")["phase"] == "Running"
    finally:
        fleet.stop()


def test_a_reached_target_shows_in_status_and_ends_the_job_as_target_reached(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {
        "mode": "sync",
        "policy": {"intervalSeconds": 1},
        "training": {"dataset": "digits", "target": {"metric": "accuracy", "value": 0.9}},
    }
    began = time.time()
    fleet = _start(cluster, "goal", spec, [0.02, 0.02], subnet=23)
    try:
        fleet.rank0.record_validation(20, 0.75, 0.5, seconds=0.1)
        wait_for("validation figures", lambda: cluster.status("goal").get("validationAccuracy") == 0.5, timeout=30)
        wide = cluster.plane.kubectl("get", "sgdjob", "goal", "-n", cluster.ns, "-o", "wide").stdout.split("\n")
        # Columns by their header's position: an empty one (BATCHES while the batches are equal) is blanks.
        heads = list(re.finditer(r"\S+", wide[0]))
        ends = [h.start() for h in heads[1:]] + [None]
        cells = {h.group(): wide[1][h.start() : end].strip() for h, end in zip(heads, ends, strict=True)}
        assert cells["VAL-LOSS"] == "0.75" and cells["VAL-ACC"] == "0.5" and cells["BATCHES"] == "", wide
        assert "VAL-ACC" not in cluster.plane.kubectl("get", "sgdjob", "goal", "-n", cluster.ns).stdout
        fleet.rank0.record_validation(40, 0.25, 0.95, seconds=0.1)
        fleet.rank0.record_target(40)
        wait_for("target kept in status", lambda: cluster.status("goal").get("targetStep") == 40, timeout=30)
        for i in range(2):  # the workers stop at the agreed step and exit 0
            cluster.end_pod(f"goal-worker-{i}", 0)
        status = wait_for("Succeeded", lambda: (s := cluster.status("goal")).get("phase") == "Succeeded" and s)
        assert {c["type"]: c["reason"] for c in status["conditions"]}["Succeeded"] == "TargetReached"
        assert 0 < status["timeToTargetSeconds"] < time.time() - began and status["step"] < 1000
        wait_for("the TargetReached event", lambda: "TargetReached" in cluster.reasons("goal"))
    finally:
        fleet.stop()
