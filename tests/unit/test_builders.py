"""Pure object builders: the pod contract, the template merge, the rendezvous and the fixed objects."""

from __future__ import annotations

import copy
import json
from typing import Any

from sgdjob_operator.api.validation import validate_spec
from sgdjob_operator.k8s.builders import (
    JobRef,
    build_config_map,
    build_rdzv_pod,
    build_secret,
    build_service,
    build_worker_pod,
    config_map_mode,
)
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.launch_contract import RunConfig

JOB = JobRef(name="j", namespace="ns", uid="u-1")
IMAGE = "registry/trainer:1"


def _spec(**extra: Any) -> Any:
    return validate_spec({"replicas": 2, "minReplicas": 1, "maxReplicas": 3, **extra})


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_worker_pod_carries_the_torchrun_contract() -> None:
    pod = build_worker_pod(JOB, _spec(nprocPerNode=4, runPolicy={"backoffLimit": 2}), 1, default_image=IMAGE)
    env = _env(pod)
    assert env["PET_NNODES"] == "1:3" and env["PET_NPROC_PER_NODE"] == "4"
    assert (
        env["PET_RDZV_BACKEND"] == "c10d"
        and env["PET_RDZV_ID"] == "u-1"
        and env["PET_RDZV_CONF"]
        == "is_host=0,join_timeout=86400,last_call_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=5"
    )
    assert env["PET_RDZV_ENDPOINT"] == "j-rdzv.j.ns.svc:29400"
    assert env["PET_MAX_RESTARTS"] == "5"  # backoffLimit + maxReplicas
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # else survivors of a rank-0 loss dial its dead store
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names.index("POD_IP") < names.index("PET_LOCAL_ADDR")  # $(POD_IP) expands only from earlier entries
    assert env["SGDJOB_CONTROL_TOKEN_FILE"] == "/etc/sgdjob/control/token"
    meta = pod["metadata"]
    assert (
        meta["name"] == "j-worker-1"
        and meta["labels"]["sgdjob.dev/job-name"] == "j"
        and meta["labels"]["sgdjob.dev/replica-index"] == "1"
    )
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "sgdjob.dev/v1alpha1",
            "kind": "SGDJob",
            "name": "j",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    spec = pod["spec"]
    assert spec["hostname"] == "j-worker-1" and spec["subdomain"] == "j" and spec["restartPolicy"] == "Never"
    container = spec["containers"][0]
    assert container["image"] == IMAGE and container["command"] == ["python", "-m", "sgdjob_trainer.agent"]
    assert container["args"] == ["-m", "sgdjob_trainer", "--config", "/etc/sgdjob/config/run-config.json"]
    assert [p["containerPort"] for p in container["ports"]] == [9400, 9401, 9402, 9403]
    assert "affinity" not in spec
    # Rank 0 says how training ended where the kubelet keeps it after the process is gone.
    assert container["terminationMessagePath"] == env["SGDJOB_TERMINATION_LOG"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_template_is_merged_not_overwritten() -> None:
    template = {
        "metadata": {"labels": {"team": "a", "sgdjob.dev/job-name": "spoof"}, "annotations": {"x": "y"}},
        "spec": {
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                        ]
                    }
                }
            },
            "containers": [
                {"name": "sidecar", "image": "proxy"},
                {
                    "name": "trainer",
                    "image": "mine:2",
                    "resources": {"limits": {"nvidia.com/gpu": 8}},
                    "env": [{"name": "EXTRA", "value": "1"}, {"name": "PET_NNODES", "value": "9:9"}],
                    "ports": [{"name": "debug", "containerPort": 5678}],
                    "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
                },
            ],
        },
    }
    spec = _spec(template=template)
    before = copy.deepcopy(spec.template)
    pod = build_worker_pod(JOB, spec, 0, default_image=IMAGE, excluded_nodes=["slow-b", "slow-a"])
    assert spec.template == before  # the spec is never mutated
    assert pod["metadata"]["labels"]["team"] == "a" and pod["metadata"]["labels"]["sgdjob.dev/job-name"] == "j"
    own = {k: v for k, v in pod["metadata"]["annotations"].items() if not k.startswith("prometheus.io/")}
    assert own == {"x": "y", "sgdjob.dev/excluded-nodes": "slow-a,slow-b"}
    ps = pod["spec"]
    assert ps["nodeSelector"] == {"gpu": "h100"} and ps["tolerations"][0]["key"] == "nvidia.com/gpu"
    sidecar, trainer = ps["containers"]
    assert sidecar == {"name": "sidecar", "image": "proxy"}
    assert trainer["image"] == "mine:2" and trainer["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["EXTRA"] == "1" and env["PET_NNODES"] == "1:3"  # the contract wins over a conflicting user value
    assert [p["containerPort"] for p in trainer["ports"]] == [5678, 9400]
    assert {m["name"] for m in trainer["volumeMounts"]} == {"ckpt", "sgdjob-config", "sgdjob-control"}
    assert {v["name"] for v in ps["volumes"]} == {"ckpt", "sgdjob-config", "sgdjob-control"}
    (term,) = ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"][0]["key"] == "zone"  # the user's term kept, ANDed with the exclusion
    assert term["matchFields"] == [  # one node a requirement: the API server allows one value per field selector
        {"key": "metadata.name", "operator": "NotIn", "values": ["slow-a"]},
        {"key": "metadata.name", "operator": "NotIn", "values": ["slow-b"]},
    ]


def test_user_command_is_kept() -> None:
    spec = _spec(
        template={
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "command": [
                            "bash",
                            "-c",
                            "torchrun -m sgdjob_trainer --config /etc/sgdjob/config/run-config.json",
                        ],
                    }
                ]
            }
        }
    )
    container = build_worker_pod(JOB, spec, 0, default_image=IMAGE)["spec"]["containers"][0]
    assert container["command"][0] == "bash" and "args" not in container


def test_rendezvous_pod_and_fixed_objects() -> None:
    spec = _spec(
        template={"spec": {"nodeSelector": {"pool": "p"}, "containers": [{"name": "trainer", "image": "mine:3"}]}}
    )
    rdzv = build_rdzv_pod(JOB, spec, default_image=IMAGE)
    assert rdzv["metadata"]["name"] == "j-rdzv" and rdzv["metadata"]["labels"]["sgdjob.dev/role"] == "rendezvous"
    assert (
        rdzv["spec"]["hostname"] == "j-rdzv"
        and rdzv["spec"]["subdomain"] == "j"
        and rdzv["spec"]["nodeSelector"] == {"pool": "p"}
    )
    (container,) = rdzv["spec"]["containers"]
    assert container["image"] == "mine:3" and container["command"][:3] == [
        "python",
        "-m",
        "sgdjob_trainer.rendezvous_store",
    ]
    # Its health endpoint, not a TCP connect, is what the kubelet's probes (and the operator) ask.
    assert container["command"][-2:] == ["--health-port", "29401"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"rendezvous": 29400, "store-health": 29401}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/healthz", "port": "store-health"}, kind
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30 and live["timeoutSeconds"] >= 5
    svc = build_service(JOB)
    assert (
        svc["spec"]["clusterIP"] == "None"
        and svc["spec"]["publishNotReadyAddresses"]
        and svc["spec"]["selector"] == {"sgdjob.dev/job-name": "j"}
    )
    assert build_secret(JOB, "tok")["stringData"] == {"token": "tok"}
    cm = build_config_map(JOB, _spec(training={"batchSize": 7}), SyncMode.ASYNC)
    run = RunConfig.model_validate(json.loads(cm["data"]["run-config.json"]))
    assert (
        run.job_name == "j"
        and run.mode is SyncMode.ASYNC
        and run.training.batch_size == 7
        and run.reference_world_size == 1
    )
    assert config_map_mode(cm) == "async"
    for obj in (rdzv, svc, cm):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
