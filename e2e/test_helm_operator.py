"""The chart's operator as an admin runs it, on real nodes (the session's Helm release, e2e/real.py: two
replicas, the webhook on): a job through its whole life (created suspended, resumed with more steps,
Succeeded, deleted by its TTL after a `helm upgrade`, its objects then deleted by the upgraded
operator); `helm upgrade` itself (Recreate: the old pods go before the new ones start; one leader
after); a graceful hand-over of the Lease (the standby answers its liveness probe as a standby naming
the leader, and takes over when the leader's pod is deleted); and every request the operator's pods
made in the session so far, read from the API server's audit log (devcluster/realconf.AUDIT_POLICY),
inside the chart's RBAC: none refused, none granted that the operator never made. `helm uninstall` is
checked when the session's release is torn down (e2e/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster.kube import KubeApi, KubeError
from devcluster.realnodes import RealCluster
from devcluster.testing import wait_for
from e2e import rbac
from e2e.real import OPERATOR_IMAGES, OPERATOR_NS, RELEASE, RealEnv, RealOperator, real_scenario_env, upgrade_operator
from tests.packaging.helm import chart_permissions

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=OPERATOR_IMAGES)]

HOLD = "sgdjob.test/hold"  # a finalizer that keeps the job's objects until the operator's clean-up has run
HEALTH_PORT = 8080  # the chart's healthPort


@pytest.fixture(scope="module")
def env(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealEnv]:
    with real_scenario_env(real_cluster, real_operator, "helm", tmp_path_factory.mktemp("helm")) as e:
        yield e


def _operator_requests(e: RealEnv, since: int = 0) -> list[rbac.Request]:
    """The operator's requests in the audit log, from byte `since` on."""
    log = e.cluster.layout.audit_log
    return rbac.requests(rbac.read_audit(log, since), f"system:serviceaccount:{OPERATOR_NS}:")


def _health(kube: KubeApi, pod: str) -> dict[str, Any]:
    """The pod's liveness answer, through the API server's pod proxy (the pod network is not the host's)."""
    try:
        doc = kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods/{pod}:{HEALTH_PORT}/proxy/healthz")
    except (KubeError, ValueError):
        return {}
    return dict(doc) if isinstance(doc, dict) else {}


def test_a_job_an_upgrade_and_a_hand_over_stay_inside_the_charts_rbac(env: RealEnv) -> None:
    kube, ns, op = env.kube, env.ns, env.operator
    start = rbac.audit_size(env.cluster.layout.audit_log)
    job = json.loads(
        env.manifest(
            "tiny",
            steps=20,
            checkpoint_dir=str(env.tmp / "ckpt"),
            replicas=1,
            min_replicas=1,
            max_replicas=1,
            mode="sync",
            policy={"intervalSeconds": 1},
        )
    )
    # Created suspended and then resumed with more steps: the new generation is written to the
    # ConfigMap made for the first, the chart's one use of configmaps/patch that does not hang on
    # timing (the policy-state ConfigMap is written twice only if the policy runs twice).
    job["spec"]["runPolicy"] = {"suspend": True}
    env.apply(json.dumps(job))
    path = f"/apis/sgdjob.dev/v1alpha1/namespaces/{ns}/sgdjobs/tiny"
    wait_for(lambda: kube.get_or_none(f"/api/v1/namespaces/{ns}/configmaps/tiny-config"), 120, "the ConfigMap")
    patch = {"spec": {"runPolicy": {"suspend": False}, "training": {"steps": 24}}}
    env.kubectl("-n", ns, "patch", "sgdjob", "tiny", "--type=merge", "-p", json.dumps(patch))

    def succeeded() -> bool:
        phase = (kube.get(path).get("status") or {}).get("phase")
        assert phase != "Failed", kube.get(path)
        return phase == "Succeeded"

    wait_for(succeeded, 240, "the SGDJob Succeeded")

    # Hold the job's objects, so the operator's own clean-up after the deletion is seen whatever the
    # garbage collector does first.
    held = env.kubectl(
        "-n", ns, "get", "service,secret,configmap", "-l", "sgdjob.dev/job-name=tiny", "-o", "name"
    ).stdout.split()
    made = {"service/tiny", "secret/tiny-control", "configmap/tiny-config"}
    assert made <= set(held) <= made | {"configmap/tiny-policy-state"}, held
    for name in held:
        env.kubectl("-n", ns, "patch", name, "--type=merge", "-p", json.dumps({"metadata": {"finalizers": [HOLD]}}))

    old = {p["metadata"]["uid"] for p in op.pods()}
    upgrade_operator(op, "--set-string", "podAnnotations.upgraded=yes")
    pods = op.pods()
    assert len(pods) == 2 and not old & {p["metadata"]["uid"] for p in pods}, "Recreate: every pod is new"
    assert all(p["metadata"]["annotations"].get("upgraded") == "yes" for p in pods)

    # The upgraded operator deletes the finished job (ttl 0) and then the job's objects: its own
    # requests, in this namespace, after the patch (the audit log from there on).
    mark = rbac.audit_size(env.cluster.layout.audit_log)
    ttl = {"spec": {"runPolicy": {"ttlSecondsAfterFinished": 0}}}
    env.kubectl("-n", ns, "patch", "sgdjob", "tiny", "--type=merge", "-p", json.dumps(ttl))
    wait_for(lambda: kube.get_or_none(path) is None, 120, "the job deleted by its TTL")
    wanted = {("", "services", "delete"), ("", "secrets", "delete"), ("", "configmaps", "delete")}

    def cleaned() -> bool:
        here = [r for r in _operator_requests(env, mark) if f"/namespaces/{ns}/" in r.uri]
        return wanted <= rbac.used(here)

    wait_for(cleaned, 60, "the operator's clean-up of the job's objects")
    for name in held:
        env.kubectl("-n", ns, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)

    # The hand-over: the standby names the leader in its liveness answer; deleting the leader's pod
    # (gracefully: it hands the Lease back) makes the standby the leader.
    leader = wait_for(op.pod, 120, "a leader")
    standby = next(p for p in op.pods() if p["metadata"]["name"] != leader["metadata"]["name"])
    holder = str(
        kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NS}/leases/{RELEASE}")["spec"]["holderIdentity"]
    )
    expected = {"role": "standby", "leader": holder}
    wait_for(lambda: _health(kube, standby["metadata"]["name"]) == expected, 60, "the standby's liveness answer")
    kube.delete(f"/api/v1/namespaces/{OPERATOR_NS}/pods/{leader['metadata']['name']}")
    wait_for(lambda: op.leader_name() not in ("", leader["metadata"]["name"]), 60, "another pod holding the Lease")
    wait_for(lambda: len(op.pods()) == 2 and op.pod(), 180, "two operator pods again, one leading")

    # Refusals are read from this test's own requests: an API server that has just restarted (the chaos
    # suite restarts it) may refuse a granted request until its RBAC caches have synced. What was used
    # is the whole session's: a request for something the chart does not grant shows there too.
    denied = rbac.denied(_operator_requests(env, start))
    assert not denied, f"the chart's RBAC refused the operator: {denied[:5]}"
    used, granted = rbac.used(_operator_requests(env)), chart_permissions(*op.helm_values())
    assert used == granted, (
        f"missing from the chart: {sorted(used - granted)}; granted but never used: {sorted(granted - used)}"
    )
