"""The Helm chart: lint, render with defaults and with every option, and dry-run on a real API server."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.controlplane import ControlPlane
from devcluster.pytest_plugin import unavailable

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "sgdjob-operator"
ALL_ON = [
    "--set", "replicaCount=2",
    "--set", "metrics.serviceMonitor.enabled=true",
    "--set", "metrics.podMonitor.enabled=true",
    "--set", "prometheusRule.enabled=true",
    "--set", "dashboards.enabled=true",
    "--set", "webhook.enabled=true",
    "--set", "webhook.certSecret=sgdjob-webhook-tls",
    "--set", "webhook.caBundle=Zm9v",
    "--set", "watchNamespaces={team-a,team-b}",
    "--set", "extraArgs={--verbose}",
    "--set", "rbac.integrations.volcano=true",
    "--set", "rbac.integrations.coscheduling=true",
    "--set", "rbac.integrations.kueue=true",
]  # fmt: skip
# Stand in for prometheus-operator's CRDs so the optional ServiceMonitor, PodMonitor and
# PrometheusRule can be dry-run too.
MONITORING_CRDS: list[dict[str, Any]] = [
    {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }
    for kind, plural in (
        ("ServiceMonitor", "servicemonitors"),
        ("PodMonitor", "podmonitors"),
        ("PrometheusRule", "prometheusrules"),
    )
]


def _helm() -> str:
    candidates = [Path(os.environ.get("KUBEBUILDER_ASSETS", "")) / "helm", Path(shutil.which("helm") or "")]
    for path in candidates:
        if path.is_file():
            return str(path)
    unavailable("helm not found in KUBEBUILDER_ASSETS or on PATH: run ../shared/k8s/install.sh")


def _helm_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, check=False, timeout=120)


def _render(*args: str) -> list[dict[str, Any]]:
    result = _helm_run("template", "sgdjob", str(CHART), "--namespace", "sgdjob-system", *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_chart_crd_is_the_generated_one() -> None:
    assert (CHART / "crds" / "sgdjobs.sgdjob.dev.yaml").read_text() == (
        ROOT / "crds" / "sgdjobs.sgdjob.dev.yaml"
    ).read_text()


def test_helm_lint() -> None:
    result = _helm_run("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


def test_values_schema_rejects_bad_values() -> None:
    result = _helm_run("template", "x", str(CHART), "--set", "healthPort=80")
    assert result.returncode != 0 and "healthPort" in result.stderr


def test_operator_pod_is_hardened() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _render()}
    deploy = docs[("Deployment", "sgdjob-sgdjob-operator")]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The chart's own metrics Service would otherwise set SGDJOB_OPERATOR_METRICS_PORT=tcp://...
    assert pod["enableServiceLinks"] is False
    assert (
        pod["securityContext"]["runAsNonRoot"] is True
        and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    )
    sc = container["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"] is True
        and sc["allowPrivilegeEscalation"] is False
        and sc["capabilities"]["drop"] == ["ALL"]
    )
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and container["resources"]["limits"]["memory"]
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    for doc in docs.values():
        for rule in doc.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], doc["metadata"]["name"]


def test_namespaced_install_uses_roles() -> None:
    kinds = [(d["kind"], d["metadata"].get("namespace")) for d in _render(*ALL_ON)]
    assert ("Role", "team-a") in kinds and ("RoleBinding", "team-b") in kinds
    assert ("ServiceMonitor", "sgdjob-system") in kinds and ("ValidatingWebhookConfiguration", None) in kinds


def _grants(doc: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in doc.get("rules", [])
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


GANG = {("scheduling.volcano.sh", "podgroups", verb) for verb in ("get", "create", "patch")} | {
    ("scheduling.x-k8s.io", "podgroups", verb) for verb in ("get", "create", "patch")
}
KUEUE = {("kueue.x-k8s.io", "workloads", verb) for verb in ("get", "create", "delete")}
PRIORITY = {("scheduling.k8s.io", "priorityclasses", "get")}


def test_gang_and_kueue_permissions_only_when_asked_for() -> None:
    default = set().union(*(_grants(d) for d in _render() if d["kind"] in ("ClusterRole", "Role")))
    assert not (GANG | KUEUE | PRIORITY) & default
    on = ALL_ON[-6:]
    cluster_role = next(d for d in _render(*on) if d["kind"] == "ClusterRole")
    assert _grants(cluster_role) >= GANG | KUEUE | PRIORITY
    only_volcano = _grants(
        next(d for d in _render("--set", "rbac.integrations.volcano=true") if d["kind"] == "ClusterRole")
    )
    assert {g for g in GANG if g[0] == "scheduling.volcano.sh"} <= only_volcano and not KUEUE & only_volcano
    # Namespaced install: the namespaced objects in each Role, the cluster-scoped PriorityClass in the ClusterRole.
    docs = _render(*on, "--set", "watchNamespaces={team-a}")
    role = next(d for d in docs if d["kind"] == "Role")
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert _grants(role) >= GANG | KUEUE and _grants(cluster_role) >= PRIORITY and not PRIORITY & _grants(role)


@pytest.mark.parametrize("options", [[], ALL_ON], ids=["defaults", "all-options"])
def test_rendered_chart_passes_server_side_dry_run(k8s_crd: ControlPlane, options: list[str]) -> None:
    k8s_crd.kubectl("apply", "-f", "-", input_text=yaml.safe_dump_all(MONITORING_CRDS))
    for crd in MONITORING_CRDS:
        k8s_crd.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
    for ns in ("sgdjob-system", "team-a", "team-b"):
        k8s_crd.kubectl("create", "namespace", ns, check=False)
    manifest = yaml.safe_dump_all(_render(*options))
    result = k8s_crd.kubectl("apply", "--dry-run=server", "-f", "-", check=False, input_text=manifest)
    assert result.returncode == 0, result.stderr


def test_operator_args_are_what_sgdjob_operator_accepts_and_the_webhook_path_is_served() -> None:
    from click.testing import CliRunner

    from sgdjob_operator.cli import main
    from sgdjob_operator.k8s.webhook import PATH

    docs = {d["kind"]: d for d in _render(*ALL_ON)}
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sgdjob"] and container["args"][0] == "operator"
    options = CliRunner().invoke(main, ["operator", "--help"], terminal_width=200).output
    for arg in container["args"][1:]:
        assert arg.split("=", 1)[0] in options, arg
    assert {
        "--webhook-port=9443",
        "--webhook-cert=/etc/sgdjob/webhook/tls.crt",
        "--webhook-key=/etc/sgdjob/webhook/tls.key",
    } <= set(container["args"])
    hook = docs["ValidatingWebhookConfiguration"]["webhooks"][0]["clientConfig"]
    assert hook["service"]["path"] == PATH and hook["caBundle"] == "Zm9v"
    # The Service routes admissions only to a replica whose webhook port listens.
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    plain = next(d for d in _render() if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert plain["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


LEASES = {("coordination.k8s.io", "leases", verb) for verb in ("create", "get", "update")}


def test_two_replicas_run_leader_election_with_rbac_for_exactly_their_lease() -> None:
    docs = _render("--set", "replicaCount=2")
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert {
        "--leader-elect",
        "--lease-name=sgdjob-sgdjob-operator",
        "--lease-namespace=sgdjob-system",
        "--lease-duration=15",
        "--renew-deadline=10",
        "--retry-period=2",
    } <= set(container["args"])
    assert any(e["name"] == "POD_NAME" for e in container["env"])
    assert deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]  # spread over nodes
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "sgdjob-system" and _grants(role) == LEASES
    named = [r for r in role["rules"] if "get" in r["verbs"]]
    assert named == [{**named[0], "resourceNames": ["sgdjob-sgdjob-operator"]}]  # only its own Lease
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # Defaults: one replica, no election, no Lease permissions.
    assert not LEASES & set().union(*(_grants(d) for d in _render()))


def _tolerations(*args: str) -> list[dict[str, Any]]:
    deploy = next(d for d in _render(*args) if d["kind"] == "Deployment")
    return list(deploy["spec"]["template"]["spec"].get("tolerations") or [])


def test_operator_leaves_a_lost_node_after_its_toleration_not_kubernetes_300_s() -> None:
    """A replica on a node that stopped reporting is evicted after nodeLostTolerationSeconds (30 s)
    and started elsewhere, so a second node lost later still leaves one; the user's own tolerations
    come with it, and null leaves Kubernetes' default (300 s, added by the API server)."""
    lost = {
        (t["key"], t["effect"], t["tolerationSeconds"])
        for t in _tolerations("--set", "replicaCount=2")
        if t["key"].startswith("node.kubernetes.io/")
    }
    assert lost == {(f"node.kubernetes.io/{taint}", "NoExecute", 30) for taint in ("unreachable", "not-ready")}
    mine = {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
    args = ["--set", "nodeLostTolerationSeconds=45"] + [f"--set=tolerations[0].{k}={v}" for k, v in mine.items()]
    tolerations = _tolerations(*args)
    assert mine in tolerations and {t.get("tolerationSeconds") for t in tolerations} == {None, 45}
    assert _tolerations("--set", "nodeLostTolerationSeconds=null") == []
    bad = _helm_run("template", "x", str(CHART), "--set", "nodeLostTolerationSeconds=-1")
    assert bad.returncode != 0 and "nodeLostTolerationSeconds" in bad.stderr


def test_leader_election_settings_that_cannot_work_are_refused_naming_the_value() -> None:
    for args, message in (
        (["replicaCount=2", "leaderElection.enabled=false"], "replicaCount > 1 needs leaderElection.enabled"),
        (["replicaCount=2", "leaderElection.renewDeadlineSeconds=15"], "renewDeadlineSeconds must be shorter"),
        (["replicaCount=2", "leaderElection.retryPeriodSeconds=6"], "retryPeriodSeconds must be at most half"),
    ):
        result = _helm_run("template", "x", str(CHART), *(a for arg in args for a in ("--set", arg)))
        assert result.returncode != 0 and message in result.stderr, result.stderr
    one = next(d for d in _render("--set", "leaderElection.enabled=true") if d["kind"] == "Deployment")
    assert one["spec"]["replicas"] == 1 and "--leader-elect" in one["spec"]["template"]["spec"]["containers"][0]["args"]


def test_webhook_ca_from_cert_manager_needs_no_ca_bundle() -> None:
    injected = [
        "--set",
        "webhook.enabled=true",
        "--set",
        "webhook.certSecret=tls",
        "--set-string",
        "webhook.annotations.cert-manager\\.io/inject-ca-from=sgdjob-system/sgdjob-webhook",
    ]
    config = next(d for d in _render(*injected) if d["kind"] == "ValidatingWebhookConfiguration")
    assert (
        config["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "sgdjob-system/sgdjob-webhook"}
        and "caBundle" not in config["webhooks"][0]["clientConfig"]
    )
    result = _helm_run("template", "x", str(CHART), "--set", "webhook.enabled=true", "--set", "webhook.certSecret=tls")
    assert result.returncode != 0 and "webhook.caBundle is required" in result.stderr
