"""Monitoring on real nodes as a cluster user sets it up: Debian's Prometheus, inside the cluster's network
(the fabric namespace, which routes to every pod), finds the operator and the worker pods by the
`prometheus.io/*` annotations the chart and the operator put on them (file-based discovery fed from the
API: Debian builds Prometheus without its Kubernetes discovery), scrapes them over the pod network, and
evaluates the chart's PrometheusRule alerts. A job with a persistent emulated
straggler (the policy may not act) must show up as a straggler and as its mode, from the operator's and
from the workers' own series.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster import realnet
from devcluster.controlplane import free_port
from devcluster.pytest_plugin import unavailable
from devcluster.realnodes import RealCluster
from devcluster.testing import wait_for
from e2e.helpers import assert_children_gone, job_status
from e2e.real import OPERATOR_IMAGES, RealEnv, RealOperator, real_scenario_env
from tests.packaging.test_chart import _render
from tests.promql import query, ready

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=OPERATOR_IMAGES)]

JOB = "watched"
PROM_PORT = 9091  # on the fabric namespace's loopback


def annotated_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """file_sd target groups from pods, by the rules of the usual annotation-driven pod job (Prometheus's
    example Kubernetes configuration: `prometheus.io/scrape`, `/port`, `/path`) plus the labels the
    chart's PodMonitor adds to worker series (sgdjob_namespace, sgdjob_job), which the dashboard and
    the alert rules select on. Debian's Prometheus is built without Kubernetes service discovery, so
    the test lists the pods itself and hands Prometheus the result as a file, as the SD would."""
    groups = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        notes = meta.get("annotations") or {}
        if notes.get("prometheus.io/scrape") != "true" or not status.get("podIP") or status.get("phase") != "Running":
            continue
        labels = {
            "__metrics_path__": notes.get("prometheus.io/path", "/metrics"),
            "namespace": meta["namespace"],
            "pod": meta["name"],
        }
        job = (meta.get("labels") or {}).get("sgdjob.dev/job-name")
        if job:
            labels |= {"sgdjob_namespace": meta["namespace"], "sgdjob_job": job}
        groups.append({"targets": [f"{status['podIP']}:{notes['prometheus.io/port']}"], "labels": labels})
    return sorted(groups, key=lambda g: str(g["targets"]))


class Prometheus:
    """Prometheus in the fabric namespace, reached from the host through devcluster/nsproxy.py."""

    def __init__(self, cluster: RealCluster, folder: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            unavailable("prometheus not installed (Debian: apt-get install prometheus; .ci/run installs it)")
        rules = next(d for d in _render("--set", "prometheusRule.enabled=true") if d["kind"] == "PrometheusRule")
        (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}))
        config = {
            "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {
                    "job_name": "kubernetes-pods",
                    "file_sd_configs": [{"files": ["targets.json"], "refresh_interval": "2s"}],
                }
            ],
        }
        self.kube, self.targets, self.discovered = cluster.kube(), folder / "targets.json", 0.0
        self.discover()
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        fabric = str(realnet.ns_path(cluster.layout.fabric_ns))
        argv = [*realnet.enter(cluster.layout.fabric_ns), binary, "--config.file=prometheus.yml"]
        argv += [f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{PROM_PORT}"]
        self.log = folder / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=folder, stdout=out, stderr=subprocess.STDOUT)
        port = free_port()
        forward = Path(realnet.__file__).with_name("nsproxy.py")
        self.forwarder = subprocess.Popen(
            [sys.executable, str(forward), "--netns", fabric, "--listen", f"127.0.0.1:{port}",
             "--connect", f"127.0.0.1:{PROM_PORT}"],
        )  # fmt: skip
        self.base = f"http://127.0.0.1:{port}"

    def discover(self) -> None:
        """One pass of discovery: the file is replaced only when the targets changed."""
        self.discovered = time.monotonic()
        text = json.dumps(annotated_targets(self.kube.get("/api/v1/pods")["items"]), indent=1)
        if not self.targets.exists() or self.targets.read_text() != text:
            tmp = self.targets.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.targets)

    def ready(self) -> bool:
        return ready(self.proc, self.base, self.log)

    def query(self, promql: str) -> list[dict[str, Any]]:
        if time.monotonic() - self.discovered > 1.0:  # the tests poll through here: discovery goes on
            self.discover()
        return query(self.base, promql)

    def rules(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.base}/api/v1/rules", timeout=5) as resp:
            return [r for g in json.loads(resp.read())["data"]["groups"] for r in g["rules"]]

    def stop(self) -> None:
        for proc in (self.forwarder, self.proc):
            proc.terminate()
            proc.wait(timeout=20)


@pytest.fixture(scope="module")
def env(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealEnv]:
    with real_scenario_env(real_cluster, real_operator, "monitor", tmp_path_factory.mktemp("monitor")) as e:
        yield e


def test_prometheus_discovers_and_scrapes_the_operator_and_workers_and_the_charts_alerts_evaluate(
    env: RealEnv, tmp_path: Path
) -> None:
    prom = Prometheus(env.cluster, tmp_path)
    try:
        straggler = {"rank": 2, "factor": 6.0}
        env.apply(
            env.manifest(
                JOB,
                steps=100_000,
                checkpoint_dir=str(env.tmp / JOB),
                emulation={"computeSeconds": 0.04, "slowdowns": [straggler]},
                policy={"stragglerThreshold": 2.5},
            )
        )
        wait_for(lambda: int(job_status(env.kube, env.ns, JOB).get("step") or 0) > 0, 300, f"{JOB} training")
        wait_for(prom.ready, 60, "prometheus ready")
        ours = f'sgdjob_namespace="{env.ns}", sgdjob_job="{JOB}"'
        # The operator's own series (its pod found by the chart's annotations).
        modes = wait_for(lambda: prom.query(f"sgdjob_operator_job_mode{{{ours}}} == 1"), 90, "the operator's mode")
        assert [m["metric"]["mode"] for m in modes] == ["sync"]
        assert modes[0]["metric"]["namespace"] == "sgdjob-system"
        stragglers = wait_for(
            lambda: prom.query(f"sgdjob_operator_job_stragglers{{{ours}}} >= 1"), 90, "the straggler counted"
        )
        assert float(stragglers[0]["value"][1]) == 1.0

        # Every worker's own series, scraped over the pod network from its pod's annotations.
        def three_workers() -> list[dict[str, Any]] | None:
            found = prom.query(f"sgdjob_mode{{{ours}}} == 1")
            return found if len(found) == 3 else None

        workers = wait_for(three_workers, 90, "3 workers' modes")
        assert sorted(w["metric"]["pod"] for w in workers) == [f"{JOB}-worker-{i}" for i in range(3)]
        assert {w["metric"]["mode"] for w in workers} == {"sync"}
        rate = wait_for(lambda: prom.query(f"sgdjob:samples_per_second:rate2m{{{ours}}} > 0"), 90, "the recording rule")
        assert float(rate[0]["value"][1]) > 0

        def all_evaluated() -> list[dict[str, Any]] | None:
            found = prom.rules()
            return found if found and all(r.get("lastEvaluation", "").startswith("2") for r in found) else None

        evaluated = wait_for(all_evaluated, 60, "every rule evaluated")
        assert {r["name"] for r in evaluated} >= {"SGDJobStragglerPersists", "SGDJobNoProgress", "SGDJobWorkerHung"}
        assert [(r["name"], r.get("lastError")) for r in evaluated if r["health"] != "ok"] == []
    finally:
        print(f"--- prometheus log tail ---\n{prom.log.read_text(errors='replace')[-2000:]}")
        prom.stop()
    env.kubectl("delete", "sgdjob", JOB, "-n", env.ns, "--wait=false")
    assert_children_gone(env.kube, env.ns, JOB)
