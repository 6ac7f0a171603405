"""The operator's kopf diff base is kopf's own, minus the copying: same essence for any job body."""

from __future__ import annotations

import kopf

from sgdjob_operator.k8s.handlers import PREFIX, SpecDiffBase


def test_the_lean_diff_base_is_kopfs_essence() -> None:
    body = kopf.Body(
        {
            "apiVersion": "sgdjob.dev/v1alpha1",
            "kind": "SGDJob",
            "metadata": {
                "name": "j",
                "uid": "u",
                "generation": 3,
                "labels": {"team": "a"},
                "annotations": {
                    "note": "kept",
                    f"{PREFIX}/last-handled-configuration": "{}",
                    "kubectl.kubernetes.io/last-applied-configuration": "{}",
                },
                "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
            },
            "spec": {"replicas": 4, "training": {"steps": 100, "faults": []}},
            "status": {"phase": "Running", "decisions": [{"action": "keep", "reason": "x" * 1000}] * 50},
        }
    )
    ours = SpecDiffBase(prefix=PREFIX, key="last-handled-configuration")
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    essence = ours.build(body=body)
    assert essence == kopfs.build(body=body)
    assert essence["spec"]["replicas"] == 4
    assert "status" not in essence and essence["metadata"] == {"labels": {"team": "a"}, "annotations": {"note": "kept"}}
    with_status = ours.build(body=body, extra_fields=["status.phase"])
    assert with_status == kopfs.build(body=body, extra_fields=["status.phase"]) and with_status["status"] == {
        "phase": "Running"
    }
