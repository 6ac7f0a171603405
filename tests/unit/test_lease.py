"""Leader election's pure core and the webhook's AdmissionReview answers: who may take the Lease and when,
the Lease objects written, timings that could not guarantee one leader, and the CLI refusing them."""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner

from sgdjob_operator.cli import main
from sgdjob_operator.k8s import lease as core
from sgdjob_operator.k8s.settings import OperatorSettings
from sgdjob_operator.k8s.webhook import admission_response


def _lease(holder: str, renew: str = "2026-01-01T00:00:00.000000Z", transitions: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": core.API_VERSION,
        "kind": "Lease",
        "metadata": {"name": "op", "namespace": "ns", "resourceVersion": "7"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "renewTime": renew,
            "leaseTransitions": transitions,
        },
    }


def test_a_free_or_missing_lease_is_taken_at_once() -> None:
    assert core.may_acquire(core.observe(None, None, 100.0, 15.0), "me", 100.0)
    assert core.may_acquire(core.observe(None, _lease(""), 100.0, 15.0), "me", 100.0)


def test_a_held_lease_is_taken_only_after_a_whole_duration_without_renewal() -> None:
    seen = core.observe(None, _lease("other"), 100.0, 15.0)
    assert not core.may_acquire(seen, "me", 114.9)
    # Reads that show the same record do not restart the clock; the local clock alone decides.
    seen = core.observe(seen, _lease("other"), 110.0, 15.0)
    assert seen.changed_at == 100.0 and core.may_acquire(seen, "me", 115.0)


def test_a_renewal_restarts_the_standbys_clock() -> None:
    seen = core.observe(None, _lease("other"), 100.0, 15.0)
    seen = core.observe(seen, _lease("other", renew="2026-01-01T00:00:02.000000Z"), 112.0, 15.0)
    assert seen.changed_at == 112.0 and not core.may_acquire(seen, "me", 126.0)
    assert core.may_acquire(seen, "me", 127.0)


def test_the_lease_duration_written_by_the_holder_wins_over_the_standbys_own() -> None:
    long = _lease("other")
    long["spec"]["leaseDurationSeconds"] = 60
    seen = core.observe(None, long, 0.0, 15.0)
    assert not core.may_acquire(seen, "me", 30.0) and core.may_acquire(seen, "me", 60.0)


def test_taking_over_counts_a_transition_and_keeps_the_version_for_optimistic_locking() -> None:
    body = core.acquired(_lease("old", transitions=2), name="op", namespace="ns", me="me", duration_s=15, wall=0.5)
    assert body["metadata"]["resourceVersion"] == "7"
    assert body["spec"]["holderIdentity"] == "me" and body["spec"]["leaseTransitions"] == 3
    assert body["spec"]["acquireTime"] == body["spec"]["renewTime"] == "1970-01-01T00:00:00.500000Z"
    fresh = core.acquired(None, name="op", namespace="ns", me="me", duration_s=15, wall=0)
    assert fresh["metadata"] == {"name": "op", "namespace": "ns"} and fresh["spec"]["leaseTransitions"] == 0


def test_renewal_moves_only_the_renew_time_and_release_frees_the_lease() -> None:
    mine = core.acquired(_lease("old"), name="op", namespace="ns", me="me", duration_s=15, wall=0)
    renewed = core.renewed(mine, 3.0)
    assert renewed["spec"] == {**mine["spec"], "renewTime": "1970-01-01T00:00:03.000000Z"}
    released = core.released(renewed, 4.0)
    assert released["spec"]["holderIdentity"] == "" and released["spec"]["leaseDurationSeconds"] == 1
    assert core.may_acquire(core.observe(None, released, 0.0, 15.0), "standby", 0.0)


def test_timings_that_could_allow_two_leaders_are_refused_naming_the_flag() -> None:
    assert core.Timings().problem() is None and core.Timings().failover_s() == 19.0
    assert "--renew-deadline" in (core.Timings(10, 10, 2).problem() or "")
    assert "--retry-period" in (core.Timings(15, 10, 6).problem() or "")
    assert "positive" in (core.Timings(15, 10, 0).problem() or "")
    result = CliRunner().invoke(main, ["operator", "--leader-elect", "--lease-duration", "5", "--renew-deadline", "8"])
    assert result.exit_code != 0 and "--renew-deadline (8s) must be shorter than --lease-duration (5s)" in result.output


def test_election_settings_come_from_the_environment() -> None:
    cfg = OperatorSettings.from_env(
        {"SGDJOB_LEADER_ELECTION": "true", "SGDJOB_LEASE_NAME": "rel", "SGDJOB_LEASE_DURATION_SECONDS": "30"}
    )
    assert cfg.leader_election and cfg.lease_name == "rel" and cfg.lease_duration_s == 30.0
    assert not OperatorSettings.from_env({}).leader_election


def _review(spec: dict[str, Any], old: dict[str, Any] | None = None, name: str = "job") -> dict[str, Any]:
    request = {
        "uid": "u1",
        "name": name,
        "object": {"metadata": {"name": name}, "spec": spec},
        "oldObject": {"spec": old} if old else None,
    }
    return admission_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})


def test_the_webhook_refuses_a_bad_spec_naming_the_field() -> None:
    answer = _review({"replicas": 1, "minReplicas": 3, "maxReplicas": 4, "training": {}})["response"]
    assert answer["uid"] == "u1" and answer["allowed"] is False
    assert answer["status"]["code"] == 422 and "minReplicas" in answer["status"]["message"]
    # An update that leaves the spec as it was passes, as in the leader's webhook.
    bad = {"replicas": 1, "minReplicas": 3, "maxReplicas": 4, "training": {}}
    assert _review(bad, old=bad)["response"]["allowed"] is True


def test_the_webhook_answer_carries_warnings_and_checks_a_new_jobs_name() -> None:
    """What kubectl prints: a stored job's warnings, and a refused name (every replica answers alike)."""
    script = {"replicas": 1, "mode": "auto", "training": {"command": ["python", "train.py"]}}
    answer = _review(script)["response"]
    assert answer["allowed"] is True and answer["warnings"][0].startswith("spec.mode: auto cannot adapt")
    refused = _review({"replicas": 1, "training": {}}, name="team.a")["response"]
    assert refused["allowed"] is False and "metadata.name" in refused["status"]["message"]
    assert "warnings" not in _review({"replicas": 1, "training": {}})["response"]
