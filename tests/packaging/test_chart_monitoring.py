"""The chart's monitoring: scrape configuration (pod annotations, PodMonitor), the Grafana dashboard
and the PrometheusRule alerts. Every series name the dashboard and the rules query must be one the
operator or the trainers really export; promtool (Debian's `prometheus` package) checks the rules
and runs their unit tests where it is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from devcluster.pytest_plugin import unavailable
from sgdjob_operator.api.validation import validate_spec
from sgdjob_operator.k8s import metrics as operator_metrics
from sgdjob_operator.k8s.builders import JobRef, build_worker_pod
from sgdjob_trainer.wire import metric_names
from tests.packaging.test_chart import _render

ON = [
    "--set", "dashboards.enabled=true",
    "--set", "prometheusRule.enabled=true",
    "--set", "metrics.podMonitor.enabled=true",
    "--set", "metrics.podMonitor.localRanks=2",
]  # fmt: skip
# PromQL words that are not series: operators, modifiers, keywords.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}
KEYWORDS |= {"inf", "nan", "atan2"}
# Aggregations: `sum by (x) (...)` puts the grouping between the name and its parenthesis.
KEYWORDS |= {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
KEYWORDS |= {"quantile", "limitk", "limit_ratio"}


def metric_names_in(expr: str) -> set[str]:
    """The series names a PromQL expression reads: identifiers left once strings, label matchers,
    ranges, grouping label lists and Grafana variables are removed, minus functions (a name followed
    by `(`) and keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names


def exported_names() -> set[str]:
    """Every sample name on the operator's and the trainers' /metrics."""
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    for family in operator_metrics.REGISTRY.collect():
        names |= {family.name + s for s in suffixes[family.type]}
    for value in vars(metric_names).values():
        if not (isinstance(value, str) and value.startswith("sgdjob_")):
            continue
        kind = "counter" if value in metric_names.COUNTERS else "gauge"
        kind = "histogram" if value == metric_names.STEP_SECONDS else kind
        names |= {value + s for s in suffixes[kind]}
    return names


def _docs(*args: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in _render(*args)}


def _rules() -> dict[str, Any]:
    rule: dict[str, Any] = _docs(*ON)[("PrometheusRule", "sgdjob-sgdjob-operator")]
    return rule


def _dashboard() -> dict[str, Any]:
    cm = _docs(*ON)[("ConfigMap", "sgdjob-sgdjob-operator-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar selects by default
    board: dict[str, Any] = json.loads(cm["data"]["sgdjob.json"])
    return board


def _dashboard_exprs(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        found = re.fullmatch(r"label_values\((.*),\s*\w+\)", query or "")
        if found:  # label_values(series, label): the label is no series
            exprs.append(found.group(1))
    return exprs


def test_the_tokenizer_finds_series_and_skips_functions_labels_and_variables() -> None:
    expr = (
        'sum by (sgdjob_job, rank) (rate(foo_total{a="b, c", d=~"$x"}[$__rate_interval]) / rate(bar[5m] offset 1h))'
        " * on (instance) group_left (rank) baz_info > 0.5e3 and on (job) sgdjob:rec:rate2m unless absent(qux)"
    )
    assert metric_names_in(expr) == {"foo_total", "bar", "baz_info", "sgdjob:rec:rate2m", "qux"}


def test_monitoring_objects_are_off_by_default_and_pods_are_annotated_for_scraping() -> None:
    docs = _docs()
    assert not {k for k in docs if k[0] in ("PodMonitor", "PrometheusRule", "ServiceMonitor")}
    assert not [k for k in docs if k[0] == "ConfigMap" and k[1].endswith("-dashboard")]
    pod = docs[("Deployment", "sgdjob-sgdjob-operator")]["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    port = next(p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")["containerPort"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    worker = build_worker_pod(
        JobRef("j", "ns", "u"), validate_spec({"training": {"metricsPort": 9500}}), 0, default_image="img"
    )
    assert worker["metadata"]["annotations"]["prometheus.io/port"] == "9500"
    assert worker["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_the_pod_monitor_scrapes_every_ranks_port_and_labels_the_job() -> None:
    monitor = _docs(*ON)[("PodMonitor", "sgdjob-sgdjob-operator-workers")]
    worker = build_worker_pod(JobRef("j", "ns", "u"), validate_spec({"nprocPerNode": 2}), 0, default_image="img")
    labels = worker["metadata"]["labels"]
    assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for p in worker["spec"]["containers"][0]["ports"]}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == sorted(ports) == ["metrics", "metrics-1"]
    targets = {r["targetLabel"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
    assert targets == {"sgdjob_namespace", "sgdjob_job"}


def test_every_series_the_dashboard_and_the_alerts_use_exists() -> None:
    rules = _rules()
    alerts = {r["alert"] for g in rules["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"SGDJobStragglerPersists", "SGDJobNoProgress", "SGDJobWorkerHung"} <= alerts
    recorded = {r["record"] for g in rules["spec"]["groups"] for r in g["rules"] if "record" in r}
    known = exported_names() | recorded
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]] + _dashboard_exprs(_dashboard())
    used: set[str] = set()
    for expr in exprs:
        names = metric_names_in(expr)
        assert names, expr
        assert names <= known, f"{sorted(names - known)} in {expr!r} is exported by nobody"
        used |= names
    for needed in ("sgdjob_operator_job_stragglers", "sgdjob_operator_job_mode", "sgdjob_operator_job_step"):
        assert needed in used  # the straggler, mode and progress series a person watches


def test_the_dashboard_is_a_grafana_dashboard_with_the_job_variables() -> None:
    board = _dashboard()
    assert board["uid"] == "sgdjob-overview" and board["title"] == "SGDJob"
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "sgdjob_namespace", "sgdjob_job"}
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles)) and {"Stragglers", "Mode the workers run", "Step"} <= set(titles)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"] if p["type"] != "row")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": _rules()["spec"]["groups"]}))
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in {"sgdjob_namespace": "ns", **labels}.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


RATE = "sgdjob:samples_per_second:rate2m"  # 600 + 1200 samples a minute: 30/s


def _alerts(at: str, name: str, *jobs: dict[str, str]) -> dict[str, Any]:
    exp = [{"exp_labels": {"severity": "warning", "sgdjob_namespace": "ns", **j}} for j in jobs]
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


def test_the_alerts_fire_for_the_faults_and_not_for_healthy_or_starting_jobs(tmp_path: Path) -> None:
    promtool = _promtool()
    groups = _rules()["spec"]["groups"]
    for group in groups:  # annotations are checked by `check rules`; here only when and for whom
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    phase = "sgdjob_operator_job_phase"
    series = [
        _series("sgdjob_operator_job_stragglers", "0 0 1x40", sgdjob_job="slow"),
        _series("sgdjob_operator_job_stragglers", "0x40", sgdjob_job="fine"),
        # Pending for 5 minutes, then Running with a step that never moves.
        _series("sgdjob_operator_job_step", "0x45", sgdjob_job="stuck"),
        _series(phase, "1x4 0x40", sgdjob_job="stuck", phase="Pending"),
        _series(phase, "0x4 1x40", sgdjob_job="stuck", phase="Running"),
        _series("sgdjob_operator_job_step", "0+10x45", sgdjob_job="moving"),
        _series(phase, "0x45", sgdjob_job="moving", phase="Pending"),
        _series(phase, "1x45", sgdjob_job="moving", phase="Running"),
        _series("sgdjob_operator_job_step", "500x45", sgdjob_job="done"),
        _series(phase, "0x45", sgdjob_job="done", phase="Pending"),
        _series(phase, "1x45", sgdjob_job="done", phase="Succeeded"),
        _series(phase, "0x45", sgdjob_job="done", phase="Running"),
        _series("sgdjob_stalled_seconds", "0+60x40", sgdjob_job="stuck", pod="stuck-worker-0"),
        _series("sgdjob_stalled_seconds", "5x40", sgdjob_job="moving", pod="moving-worker-0"),
        _series("sgdjob_samples_total", "0+600x10", sgdjob_job="moving", instance="a"),
        _series("sgdjob_samples_total", "0+1200x10", sgdjob_job="moving", instance="b"),
    ]
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    _alerts("10m", "SGDJobStragglerPersists"),
                    _alerts("20m", "SGDJobStragglerPersists", {"sgdjob_job": "slow"}),
                    _alerts("12m", "SGDJobNoProgress"),  # Running only 7 minutes: no full window yet
                    _alerts("25m", "SGDJobNoProgress", {"sgdjob_job": "stuck"}),
                    _alerts("9m", "SGDJobWorkerHung"),
                    _alerts("15m", "SGDJobWorkerHung", {"sgdjob_job": "stuck", "pod": "stuck-worker-0"}),
                ],
                "promql_expr_test": [
                    {
                        "expr": RATE,
                        "eval_time": "5m",
                        "exp_samples": [
                            {
                                "labels": RATE + '{sgdjob_namespace="ns", sgdjob_job="moving"}',
                                "value": 30,
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
