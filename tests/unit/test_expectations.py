"""Pods a pass creates are expected until a watch event shows them: until then the job's next pass
lists its pods from etcd (the API server's watch cache could lag our own creates, and a plan that
does not see a pod it created would create it again), and their ADDED events do not wake the job."""

from __future__ import annotations

from typing import Any

from sgdjob_operator.k8s.builders import JobRef
from sgdjob_operator.k8s.runtime import Runtime
from sgdjob_operator.k8s.settings import OperatorSettings

JOB = JobRef(namespace="team", name="j", uid="u-j")


def _runtime() -> Runtime:
    return Runtime(settings=OperatorSettings(), kube=None, http=None)  # type: ignore[arg-type]


def _pod(name: str, namespace: str = "team") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"u-{name}", "labels": {}}}


def test_a_job_with_pods_in_flight_reads_its_pods_fresh_until_their_events_come() -> None:
    rt = _runtime()
    assert not rt.awaits_pods(JOB)  # nothing created: the watch cache is as fresh as our events
    rt.expected_pods.update({("team", "j-worker-0"), ("team", "j-rdzv")})
    assert rt.awaits_pods(JOB)
    assert not rt.awaits_pods(JobRef(namespace="other", name="j", uid="u-o"))
    assert not rt.awaits_pods(JobRef(namespace="team", name="k", uid="u-k"))
    assert not rt.pod_changed("ADDED", _pod("j-worker-0"))  # our own create: no second pass
    assert rt.awaits_pods(JOB)
    # After a watch restart the pod comes as a re-list's event (no ADDED): the cache has it all the same.
    assert rt.pod_changed("", _pod("j-rdzv"))
    assert not rt.awaits_pods(JOB)


def test_a_pod_nobody_expected_wakes_its_job() -> None:
    rt = _runtime()
    assert rt.pod_changed("ADDED", _pod("j-worker-3"))
