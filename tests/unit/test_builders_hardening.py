"""Worker and rendezvous pods are hardened by default (restricted profile where training allows) and
the template can still ask for what a real image needs."""

from __future__ import annotations

from typing import Any

from sgdjob_operator.api.validation import validate_spec
from sgdjob_operator.k8s.builders import JobRef, build_rdzv_pod, build_worker_pod

JOB = JobRef(name="j", namespace="ns", uid="u-1")
OURS = "ghcr.io/sgdjob/trainer:0.1.0"  # the project's trainer image: USER 10001


def _spec(template_spec: dict[str, Any] | None = None) -> Any:
    return validate_spec({"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "template": {"spec": template_spec or {}}})


def _pods(template_spec: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    spec = _spec(template_spec)
    return [
        build_worker_pod(JOB, spec, 0, default_image=OURS)["spec"],
        build_rdzv_pod(JOB, spec, default_image=OURS)["spec"],
    ]


def test_default_pods_are_restricted_and_have_no_api_access() -> None:
    worker, rdzv = _pods()
    # A non-root trainer reads the control token (a root-owned 0400 file) through the volume's group;
    # without it /control stays disabled and no mode switch ever reaches the workers.
    assert worker["securityContext"].pop("fsGroup") == 10001 and "fsGroup" not in rdzv["securityContext"]
    assert _pods({"securityContext": {"fsGroup": 2000}})[0]["securityContext"]["fsGroup"] == 2000
    for pod in (worker, rdzv):
        sc = pod["containers"][0]["securityContext"]
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True}
        assert sc == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert pod["automountServiceAccountToken"] is False
        # Service link variables would overwrite the torchrun contract (a Service `master`: MASTER_PORT).
        assert pod["enableServiceLinks"] is False


def test_a_users_image_may_run_as_root_but_keeps_the_other_restrictions() -> None:
    for pod in _pods({"containers": [{"name": "trainer", "image": "my/torch:2"}]}):
        assert (
            "runAsNonRoot" not in pod["securityContext"]
            and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        )
        assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_template_wins_where_it_speaks() -> None:
    template = {
        "securityContext": {"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}},
        "automountServiceAccountToken": True,
        "containers": [
            {
                "name": "trainer",
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}, "allowPrivilegeEscalation": True},
            }
        ],
    }
    worker = build_worker_pod(JOB, _spec(template), 0, default_image=OURS)["spec"]
    assert worker["securityContext"] == {
        "runAsUser": 0,
        "seccompProfile": {"type": "Unconfined"},
        "fsGroup": 10001,
    }  # no runAsNonRoot against runAsUser 0
    assert worker["automountServiceAccountToken"] is True
    sc = worker["containers"][0]["securityContext"]
    assert sc == {"capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}, "allowPrivilegeEscalation": True}


def test_privileged_containers_get_no_contradicting_fields() -> None:
    worker = build_worker_pod(
        JOB,
        _spec({"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]}),
        0,
        default_image=OURS,
    )["spec"]
    assert worker["containers"][0]["securityContext"] == {"privileged": True}


def test_sidecars_are_left_as_written() -> None:
    worker = build_worker_pod(
        JOB, _spec({"containers": [{"name": "trainer"}, {"name": "log", "image": "busybox"}]}), 0, default_image=OURS
    )["spec"]
    assert "securityContext" not in worker["containers"][1]
