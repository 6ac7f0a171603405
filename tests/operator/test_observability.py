"""What a person reads about a job: `kubectl describe sgdjob` on a real API server, with the
operator scraping the trainer's own Telemetry and TrainerServer on loopback pod IPs, their compute
emulated (trainer_fleet.py, as in test_adaptation).

A healthy run has moments when its workers do not answer (Running before the trainer serves
/status, exiting after training): none of them is a Warning. The policy's state is kept out of
status, and an older operator's copy in status is moved out and resumed from. A real Prometheus
(Debian's package) scrapes the operator and the workers and evaluates the chart's rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.controlplane import free_port
from devcluster.pytest_plugin import unavailable
from sgdjob_operator.policy.state import PolicyState
from tests.operator.conftest import GROUP, PLURAL, VERSION, Cluster, Operator, wait_for
from tests.operator.test_adaptation import _free_port, _token
from tests.operator.trainer_fleet import BATCH, Fleet
from tests.packaging.test_chart import _render
from tests.promql import query
from tests.promql import ready as prometheus_ready

pytestmark = pytest.mark.k8s
POLICY = {"intervalSeconds": 1, "persistenceIntervals": 2, "allowedActions": ["switchMode"]}


def _apply(cluster: Cluster, name: str, subnet: int, count: int = 2) -> tuple[list[str], int, str]:
    hosts = [f"127.0.{subnet}.{i + 2}" for i in range(count)]
    port = _free_port(hosts)
    spec = {"replicas": count, "mode": "auto", "policy": POLICY, "training": {"metricsPort": port, "batchSize": BATCH}}
    cluster.apply(name, spec)
    token = _token(cluster, name)
    wait_for(f"{count} pods", lambda: len(cluster.pods(name)) == count)
    return hosts, port, token


def _operator_metrics(operator: Operator) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _scrape_errors(operator: Operator) -> float:
    lines = _operator_metrics(operator).splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith("sgdjob_operator_scrape_errors_total"))


def _policy_state(cluster: Cluster, name: str) -> dict[str, Any] | None:
    items = cluster.core.list_namespaced_config_map(cluster.ns, field_selector=f"metadata.name={name}-policy-state")
    if not items.items or not items.items[0].data:
        return None
    data: dict[str, Any] = json.loads(items.items[0].data["policy-state.json"])
    return data


def test_a_healthy_run_has_no_warning_from_start_to_succeeded_and_describe_reads_as_a_story(
    cluster: Cluster, operator: Operator
) -> None:
    hosts, port, token = _apply(cluster, "calm", subnet=30)
    fleet: Fleet | None = None
    try:
        # The kubelet reports the pods Running before torchrun's workers serve /metrics (imports, rendezvous).
        errors_before = _scrape_errors(operator)
        for i, host in enumerate(hosts):
            cluster.run_pod(f"calm-worker-{i}", host, node=f"node-{i}")
        wait_for("failed scrapes of starting workers", lambda: _scrape_errors(operator) >= errors_before + 4)
        fleet = Fleet(hosts, port, [0.02] * 2, token)
        wait_for("Running with steps", lambda: (s := cluster.status("calm")).get("step", 0) > 0 and s["mode"] == "sync")
        state = wait_for(
            "policy state kept", lambda: (p := _policy_state(cluster, "calm")) and p["evaluations"] > 1 and p
        )
        assert set(state["ranks"]["rank"]) == {0, 1}
        assert "policyState" not in cluster.status("calm").get("controller", {})

        # What dashboards and alerts read: the job's mode, stragglers and step on the operator's /metrics.
        job = f'sgdjob_job="calm",sgdjob_namespace="{cluster.ns}"'
        text = _operator_metrics(operator)
        assert f'sgdjob_operator_job_mode{{mode="sync",{job}}} 1.0' in text, text
        assert f"sgdjob_operator_job_stragglers{{{job}}} 0.0" in text
        assert f'sgdjob_operator_job_phase{{phase="Running",{job}}} 1.0' in text
        step = next(ln for ln in text.splitlines() if ln.startswith(f"sgdjob_operator_job_step{{{job}}}"))
        assert float(step.split()[-1]) > 0

        described = cluster.plane.kubectl("describe", "sgdjob", "calm", "-n", cluster.ns).stdout
        assert "Phase:" in described and "Running" in described and "Events:" in described, described
        assert "Policy State" not in described and "shapeStreak" not in described, described

        # Training ends: the trainers stop serving, then their containers exit 0.
        fleet.stop()
        fleet = None
        errors_before = _scrape_errors(operator)
        wait_for("failed scrapes of exiting workers", lambda: _scrape_errors(operator) >= errors_before + 4)
        for i in range(2):
            cluster.end_pod(f"calm-worker-{i}", 0)
        wait_for("Succeeded", lambda: cluster.status("calm").get("phase") == "Succeeded")
        # A pass after the end could still post a Warning: wait for two more, not for a fixed time.
        ended = operator.passes()
        wait_for("two passes after the end", lambda: operator.passes() >= ended + 2, timeout=30)
        events = cluster.events("calm")
        assert [(e.reason, e.message) for e in events if e.type == "Warning"] == []
        assert "Succeeded" in {e.reason for e in events} or "WorkersSucceeded" in {e.reason for e in events}, [
            e.reason for e in events
        ]
        described = cluster.plane.kubectl("describe", "sgdjob", "calm", "-n", cluster.ns).stdout
        assert "Warning" not in described and "ScrapeFailed" not in described, described
    finally:
        if fleet is not None:
            fleet.stop()


def test_an_older_operators_policy_state_in_status_is_moved_out_and_resumed_from(
    cluster: Cluster, operator: Operator
) -> None:
    hosts, port, token = _apply(cluster, "old", subnet=31)
    fleet = Fleet(hosts, port, [0.02] * 2, token)
    try:
        for i, host in enumerate(hosts):
            cluster.run_pod(f"old-worker-{i}", host, node=f"node-{i}")
        wait_for("Running with steps", lambda: cluster.status("old").get("step", 0) > 0)
        # What an older operator left: the state in status, no ConfigMap.
        operator.stop()
        cluster.core.delete_namespaced_config_map("old-policy-state", cluster.ns)
        legacy = json.dumps(PolicyState(evaluations=1000, jitter=0.125).to_dict())
        cluster.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, cluster.ns, PLURAL, "old", {"status": {"controller": {"policyState": legacy}}}
        )
        assert cluster.status("old")["controller"]["policyState"] == legacy
        operator.start()
        state = wait_for(
            "state moved and resumed", lambda: (p := _policy_state(cluster, "old")) and p["evaluations"] > 1000 and p
        )
        assert state["version"] == json.loads(legacy)["version"]
        wait_for("status without it", lambda: "policyState" not in cluster.status("old")["controller"])
        described = cluster.plane.kubectl("describe", "sgdjob", "old", "-n", cluster.ns).stdout
        assert "Policy State" not in described, described
    finally:
        fleet.stop()


def test_prometheus_scrapes_the_operator_and_the_workers_and_the_charts_rules_evaluate(
    cluster: Cluster, operator: Operator, tmp_path: Path
) -> None:
    """Debian's `prometheus` against the operator's and the trainers' /metrics, with the chart's
    rules loaded: the straggler and mode series are there, and every rule evaluates."""
    binary = shutil.which("prometheus")
    if binary is None:
        unavailable("prometheus not installed (Debian: apt-get install prometheus)")
    groups = _render("--set", "prometheusRule.enabled=true")
    rules = next(d for d in groups if d["kind"] == "PrometheusRule")["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}))
    hosts, port, token = _apply(cluster, "prom", subnet=32)
    fleet = Fleet(hosts, port, [0.02] * 2, token)
    web = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {"job_name": "sgdjob-operator", "static_configs": [{"targets": [f"127.0.0.1:{operator.metrics_port}"]}]},
            {  # what the chart's PodMonitor makes of the worker pods
                "job_name": "sgdjob-workers",
                "static_configs": [
                    {
                        "targets": [f"{h}:{port}" for h in hosts],
                        "labels": {"sgdjob_namespace": cluster.ns, "sgdjob_job": "prom"},
                    }
                ],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    argv = [binary, "--config.file=prometheus.yml", f"--storage.tsdb.path={tmp_path / 'data'}"]
    argv += [f"--web.listen-address=127.0.0.1:{web}"]
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{web}"
    job = f'sgdjob_namespace="{cluster.ns}", sgdjob_job="prom"'
    try:
        for i, host in enumerate(hosts):
            cluster.run_pod(f"prom-worker-{i}", host, node=f"node-{i}")
        wait_for("Running with steps", lambda: cluster.status("prom").get("step", 0) > 0, timeout=60)
        wait_for("prometheus ready", lambda: prometheus_ready(proc, base, tmp_path / "prometheus.log"), timeout=60)
        modes = wait_for("the mode series", lambda: query(base, f"sgdjob_operator_job_mode{{{job}}} == 1"), timeout=60)
        assert [m["metric"]["mode"] for m in modes] == ["sync"]
        stragglers = query(base, f"sgdjob_operator_job_stragglers{{{job}}}")
        assert [float(s["value"][1]) for s in stragglers] == [0.0]
        # Each target is scraped on its own 1 s schedule: both workers' series come within a few.
        workers_modes = wait_for(
            "both workers' mode series",
            lambda: len(found := query(base, f"sgdjob_mode{{{job}}} == 1")) == 2 and found,
            timeout=30,
        )
        assert [m["metric"]["mode"] for m in workers_modes] == ["sync", "sync"]
        rate = wait_for(
            "the recording rule", lambda: query(base, f"sgdjob:samples_per_second:rate2m{{{job}}} > 0"), timeout=60
        )
        assert float(rate[0]["value"][1]) > 0

        def evaluated() -> list[dict[str, Any]] | None:
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as resp:
                found = [r for g in json.loads(resp.read())["data"]["groups"] for r in g["rules"]]
            return found if all(r.get("lastEvaluation", "").startswith("2") for r in found) else None

        evaluated_rules = wait_for("every rule evaluated", evaluated, timeout=30)
        assert {r["name"] for r in evaluated_rules} >= {
            "SGDJobStragglerPersists",
            "SGDJobNoProgress",
            "SGDJobWorkerHung",
        }
        assert [(r["name"], r.get("lastError")) for r in evaluated_rules if r["health"] != "ok"] == []
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
        fleet.stop()
