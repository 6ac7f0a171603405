"""An unmodified torchrun script on real nodes (issue #39's target): examples/ddp-script, the plain DDP
script in the style of the official tutorial, runs as an SGDJob in command mode (`training.command`) on
three kubelet nodes, loses worker-0's pod mid-run (the pod with rank 0, which writes the checkpoint),
is scaled from 3 workers to 2 with `kubectl scale`, and ends Succeeded, each new world resuming from the
script's own checkpoint. SGDJob does nothing to the script: it restarts the world (torchrun's elastic
agent in every pod: SGDJob's, which the image holds), replaces the pod, and re-forms the world at the
new size without waiting torch's last call. A script that crashes at import on every worker fails
the job at its backoffLimit instead of looping on a closed rendezvous.

The script and its checkpoint live on the host, mounted into every pod (hostPath: the nodes share the
host's filesystem), as the real-node goodput benchmark runs its DDP baseline."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.realnodes import RealCluster
from devcluster.testing import Obj, wait_for
from e2e.helpers import job_events, job_status, worker_pods
from e2e.real import OPERATOR_IMAGES, RealEnv, RealOperator, real_scenario_env
from tests.local.example_runs import REPO

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=OPERATOR_IMAGES)]

JOB = "ddpscript"
EPOCHS = 40
START_TIMEOUT = 240.0
RECOVER_TIMEOUT = 240.0
EPOCH_LINE = re.compile(r"epoch (\d+): loss [0-9.naninf]+ \(world (\d+)\); checkpoint saved")
START_LINE = re.compile(r"rank (\d+)/(\d+) restart \d+: starting at epoch (\d+)")


@pytest.fixture(scope="module")
def env(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealEnv]:
    with real_scenario_env(real_cluster, real_operator, "command", tmp_path_factory.mktemp("command")) as e:
        yield e


def manifest(run: Path) -> dict[str, Any]:
    """Three workers, one per node; the script's checkpoint in `run` (the host's, in every pod)."""
    script = REPO / "examples" / "ddp-script" / "train.py"
    command = ["python", str(script), "--epochs", str(EPOCHS), "--checkpoint", str(run / "ckpt.pt")]
    command += ["--step-seconds", "0.05"]
    mounts = [
        {"name": "run", "mountPath": str(run)},
        {"name": "code", "mountPath": str(script.parent), "readOnly": True},
    ]
    volumes = [
        {"name": "run", "hostPath": {"path": str(run), "type": "Directory"}},
        {"name": "code", "hostPath": {"path": str(script.parent), "type": "Directory"}},
    ]
    container = {"name": "trainer", "volumeMounts": mounts, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    return {
        "apiVersion": "sgdjob.dev/v1alpha1",
        "kind": "SGDJob",
        "metadata": {"name": JOB},
        "spec": {
            "replicas": 3,
            "minReplicas": 2,
            "maxReplicas": 3,
            "nprocPerNode": 1,
            "mode": "sync",
            "training": {"command": command},
            "template": {"spec": {"containers": [container], "volumes": volumes}},
        },
    }


def logs(e: RealEnv) -> str:
    return "\n".join(e.job_logs(JOB).values())


def epochs_saved(e: RealEnv) -> list[tuple[int, int]]:
    """(epoch, world) of every checkpoint rank 0 reported, in every life of every pod."""
    return sorted((int(a), int(b)) for a, b in EPOCH_LINE.findall(logs(e)))


def live_workers(e: RealEnv, n: int, not_uid: str = "") -> list[Obj] | None:
    pods = [p for p in worker_pods(e.kube, e.ns, JOB) if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != n or not all(p["status"].get("phase") == "Running" for p in pods):
        return None
    if not_uid and any(p["metadata"]["uid"] == not_uid for p in pods):
        return None
    return pods


def finished(e: RealEnv) -> Obj | None:
    st = job_status(e.kube, e.ns, JOB)
    return st if st.get("phase") in ("Succeeded", "Failed") else None


def saved_after(e: RealEnv, epoch: int, world: int, what: str, timeout: float) -> int:
    """Wait for a checkpoint past `epoch` written by a world of `world`; its epoch."""
    found = wait_for(
        lambda: max((ep for ep, w in epochs_saved(e) if ep > epoch and w == world), default=None),
        timeout,
        f"{what}: a checkpoint past epoch {epoch} by a world of {world} (saw {epochs_saved(e)[-3:]})",
    )
    return int(found)


def test_11_an_unmodified_ddp_script_survives_losing_worker_0_and_a_rescale(env: RealEnv) -> None:
    run = env.tmp / JOB
    run.mkdir(parents=True, exist_ok=True)
    run.chmod(0o777)  # the trainer image runs as uid 10001
    env.apply(json.dumps(manifest(run)))
    first = saved_after(env, -1, 3, "the script trains on 3 workers", START_TIMEOUT)

    # worker-0's pod goes: rank 0, the one that writes the checkpoint.
    pods = wait_for(lambda: live_workers(env, 3), 60, "3 live workers")
    zero = next(p for p in pods if p["metadata"]["name"] == f"{JOB}-worker-0")
    env.kubectl("delete", "pod", f"{JOB}-worker-0", "-n", env.ns, "--wait=false")
    wait_for(lambda: live_workers(env, 3, not_uid=zero["metadata"]["uid"]), RECOVER_TIMEOUT, "worker-0 replaced")
    after_loss = saved_after(env, first, 3, "training goes on at 3 after losing worker-0", RECOVER_TIMEOUT)
    starts = [(int(r), int(w), int(ep)) for r, w, ep in START_LINE.findall(logs(env))]
    assert any(w == 3 and ep > 0 for _, w, ep in starts), f"no world resumed from the checkpoint: {starts}"

    # kubectl scale: the world re-forms at 2 and resumes from the checkpoint again.
    env.kubectl("scale", f"sgdjob/{JOB}", "--replicas=2", "-n", env.ns)
    saved_after(env, after_loss, 2, "training goes on at 2 workers", RECOVER_TIMEOUT)
    starts = [(int(r), int(w), int(ep)) for r, w, ep in START_LINE.findall(logs(env))]
    assert any(w == 2 and ep > after_loss - 1 for _, w, ep in starts), f"the world of 2 did not resume: {starts}"
    # The image holds SGDJob, so the pods run our agent, not plain torchrun: the removed worker is taken
    # off the rendezvous at once and the world of 2 forms at the intended size, without torch's
    # heartbeats and last call (plain torchrun: 24-27 s here).
    said = logs(env)
    assert "was removed by the job's controller: off the rendezvous" in said, said[-3000:]
    assert "rendezvous: 2 nodes joined, the job's intended size: round complete" in said, said[-3000:]

    st = wait_for(lambda: finished(env), RECOVER_TIMEOUT, f"{JOB} finished")
    assert st["phase"] == "Succeeded", st.get("conditions")
    assert "done: 40 epochs" in logs(env)
    # Every epoch was trained and checkpointed, none skipped by a restart (from the first one whose log
    # is still on a node: the lost worker-0's first life took its log with its pod).
    saved = {ep for ep, _ in epochs_saved(env)}
    assert saved == set(range(min(saved), EPOCHS)), sorted(saved)


def test_12_a_script_that_crashes_at_import_on_every_worker_fails_the_job(env: RealEnv) -> None:
    """Every worker's script exits 1 at once (a module the image lacks). Each pod's agent spends its
    restarts in seconds and, ending, closes the rendezvous, so the pods made next find it closed and
    exit 3, which counts against nothing: the job must get a fresh store (a RendezvousClosed Warning),
    count the new world's crashes and end Failed at its backoffLimit, not make pods for ever (before
    51be0fb it did, for minutes, on real nodes)."""
    job = "importerror"
    doc = manifest(env.tmp / job)
    doc["metadata"]["name"] = job
    spec = doc["spec"]
    spec |= {"replicas": 2, "minReplicas": 2, "maxReplicas": 2, "runPolicy": {"backoffLimit": 3}}
    spec["training"] = {"command": ["python", "-c", "import sgdjob_e2e_no_such_module"]}
    container = {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    spec["template"] = {"spec": {"containers": [container]}}
    env.apply(json.dumps(doc))
    st = wait_for(lambda: (s := job_status(env.kube, env.ns, job)).get("phase") == "Failed" and s, 300, f"{job} Failed")
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "backoffLimit 3" in failed["message"], failed
    reasons = [e.get("reason") for e in job_events(env.kube, env.ns, job)]
    assert "RendezvousClosed" in reasons, reasons
    env.kubectl("delete", "sgdjob", job, "-n", env.ns, "--wait=false")
