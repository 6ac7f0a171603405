"""The user's scenarios on real kubelet nodes (containerd, pod network, kube-proxy, cluster DNS), with the
operator installed by `helm install` as a Deployment of the project's image (e2e/real.py).

One small SGDJob ("quick": 3 workers, emulated compute) carries scenarios 1, 7, 4, 6, 5 and 8 in that
order, as a user would meet them on one job: it starts and shows in `kubectl get`, bad jobs applied
beside it are refused without touching it, it survives the loss of worker 0, is scaled down, outlives
an operator crash, finishes, and is deleted. Tests run in file order and share the job (module
fixture); a failure early on makes the later ones fail too, each with its own message.
The job's policy may not act (allowedActions: []), so adaptation cannot interleave with the faults;
test_scenarios_adapt.py covers adaptation. Everything a test reads of a pod goes the way a cluster
user's would: `kubectl logs`, and a trainer's /status through the API server's pod proxy.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import pytest

from devcluster.realnodes import RealCluster
from devcluster.testing import Obj, wait_for
from e2e.helpers import (
    Env,
    assert_children_gone,
    get_job,
    job_status,
    kubectl_table,
    worker_pods,
)
from e2e.real import OPERATOR_IMAGES, OPERATOR_NS, OPERATOR_REPLICAS, RELEASE, RealEnv, RealOperator, real_scenario_env

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=OPERATOR_IMAGES)]

JOB = "quick"
STEPS = 900
# 0.1 s of emulated compute per step: at most 10 steps/s, so the job outlives the faults of tests 1-5
# even on an otherwise idle machine, where 0.02 s let it finish in 40 s. The faults themselves cost
# most of their time in restarts from checkpoints: the job stood at step 92 when test 5 ran (a green
# run here), so 900 steps leave a wide margin and test 1.5 waits ~1.5 min, not ~3.
COMPUTE_S = 0.1
CHECKPOINT_INTERVAL = 50  # sgdjob_manifest's intervalSteps
START_TIMEOUT = 240.0  # pods start torch (slow on a loaded 2-core machine) and rendezvous
RECOVER_TIMEOUT = 240.0  # a membership change: torchrun's re-rendezvous (incl. its 30 s last call) + restart


@pytest.fixture(scope="module")
def env(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealEnv]:
    with real_scenario_env(real_cluster, real_operator, "scenarios", tmp_path_factory.mktemp("scenarios")) as e:
        yield e


def step(e: Env) -> int:
    return int(job_status(e.kube, e.ns, JOB).get("step") or 0)


def uids(pods: list[Obj]) -> dict[str, str]:
    return {str(p["metadata"]["name"]): str(p["metadata"]["uid"]) for p in pods}


def running_workers(e: Env, n: int, *, world: bool = False, not_uid: str = "") -> list[Obj] | None:
    """Exactly `n` live worker pods, all Running (with `world`: every trainer reports a world of `n`;
    with `not_uid`: none has that uid, i.e. a replaced pod's successor is there)."""
    pods = [p for p in worker_pods(e.kube, e.ns, JOB) if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != n or not all(p["status"].get("phase") == "Running" for p in pods):
        return None
    if not_uid and not_uid in uids(pods).values():
        return None
    return pods if not world or world_sizes(e, pods) == [n] * n else None


def world_sizes(e: Env, pods: list[Obj]) -> list[int]:
    """Each worker's world size from its trainer's /status (what `curl <pod>:9400/status` shows)."""
    out = []
    for pod in pods:
        doc = e.pod_json(pod, 9400, "/status")
        out.append(int(doc.get("worldSize", 0)) if doc else 0)
    return out


def advances(e: Env, past: int, timeout: float, what: str) -> int:
    return wait_for(lambda: (s := step(e)) > past and s, timeout, f"{what}: step past {past} (now {step(e)})")


@pytest.fixture(scope="module")
def quick(env: Env) -> str:
    env.apply(
        env.manifest(
            JOB, steps=STEPS, checkpoint_dir=str(env.tmp / "checkpoints"), emulation={"computeSeconds": COMPUTE_S}
        )
    )
    wait_for(
        lambda: job_status(env.kube, env.ns, JOB).get("phase") == "Running" and step(env) > 0,
        START_TIMEOUT,
        "quick Running with steps",
    )
    return JOB


def test_0_the_operator_runs_from_the_chart_as_a_locked_down_deployment(env: RealEnv) -> None:
    """What `helm install` made: the project's operator image in a real container, non-root, with a
    read-only root filesystem, and the liveness endpoint the kubelet probes answering."""
    deploy = env.kube.get(f"/apis/apps/v1/namespaces/{OPERATOR_NS}/deployments/{RELEASE}")
    assert deploy["status"].get("readyReplicas") == OPERATOR_REPLICAS, deploy["status"]
    pod = env.operator.pod()
    assert pod is not None
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "sgdjob/operator:dev" and container["securityContext"]["readOnlyRootFilesystem"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return env.kubectl("exec", "-n", OPERATOR_NS, pod["metadata"]["name"], "--", *argv, check=False)

    assert run("id", "-u").stdout.strip() == "10001"
    wrote = run("touch", "/written-by-the-test")
    assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr, wrote
    health = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8080/healthz', timeout=5).status)"
    assert run("python", "-c", health).stdout.strip() == "200"


def test_1_apply_runs_and_kubectl_shows_progress(env: Env, quick: str) -> None:
    pods = wait_for(lambda: running_workers(env, 3), 30, "3 running workers")
    assert len({p["spec"]["nodeName"] for p in pods}) == 3, "one GPU per worker: three nodes"
    rdzv = env.kube.get(f"/api/v1/namespaces/{env.ns}/pods/{quick}-rdzv")
    assert rdzv["status"]["phase"] == "Running"
    first = step(env)
    advances(env, first, 60, "training advances")
    (row,) = kubectl_table(env, "sgdjobs", "-n", env.ns)
    assert row["NAME"] == quick and row["PHASE"] == "Running" and row["MODE"] == "sync" and row["READY"] == "3/3", row
    assert int(row["STEP"]) > 0, row
    assert sorted(world_sizes(env, pods)) == [3, 3, 3]

    # `kubectl logs` of a worker is the trainer's own output. Rank 0 logs, the others stay quiet, and
    # which pod holds rank 0 is the rendezvous' choice, not the pod's name.
    def rank0_logs() -> list[str]:
        return [name for name in uids(pods) if f"job {quick}: world 3" in env.logs(name)]

    assert len(wait_for(rank0_logs, 60, "the trainer's start line in one worker's log")) == 1


def test_7_bad_sgdjobs_are_refused_naming_the_field(env: Env, quick: str) -> None:
    before = uids(worker_pods(env.kube, env.ns, quick))
    ckpt = str(env.tmp / "bad")
    for field, manifest in (
        ("spec.mode", env.manifest("bad-mode", steps=10, checkpoint_dir=ckpt, mode="turbo")),
        ("spec.replicas", env.manifest("bad-replicas", steps=10, checkpoint_dir=ckpt, replicas=0, min_replicas=1)),
        (
            "spec.training.batchSize",
            env.manifest("bad-batch", steps=10, checkpoint_dir=ckpt, training={"batchSize": 0}),
        ),
    ):
        result = env.kubectl("apply", "-n", env.ns, "-f", "-", input_text=manifest, check=False)
        assert result.returncode != 0 and field in result.stderr, (field, result.stderr)
    assert [
        j["metadata"]["name"] for j in env.kube.get(f"/apis/sgdjob.dev/v1alpha1/namespaces/{env.ns}/sgdjobs")["items"]
    ] == [quick]

    # The schema cannot compare fields; the chart's validating webhook (the operator's, reached by
    # the API server through its Service) does, at admission, naming the field.
    bounds = env.manifest("bad-bounds", steps=10, checkpoint_dir=ckpt, replicas=2, min_replicas=3, max_replicas=3)
    result = env.kubectl("apply", "-n", env.ns, "-f", "-", input_text=bounds, check=False)
    assert result.returncode != 0, result.stdout
    assert "validate.sgdjob.dev" in result.stderr and "minReplicas" in result.stderr, result.stderr
    assert get_job(env.kube, env.ns, "bad-bounds") is None

    # Nothing already running was disturbed: the same pods, still training.
    assert uids(worker_pods(env.kube, env.ns, quick)) == before
    advances(env, step(env), 60, "quick still trains")
    assert job_status(env.kube, env.ns, quick)["phase"] == "Running"


def lost_steps(e: Env, pods: list[Obj]) -> list[int]:
    """What the resumed rank 0 logs: `restart: N steps lost (reached R, resumed at C)`."""
    found = []
    for pod in pods:
        found += [int(n) for n in re.findall(r"restart: (\d+) steps lost", e.logs(str(pod["metadata"]["name"])))]
    return found


def test_4_losing_worker_0_recovers_from_the_checkpoint(env: Env, quick: str) -> None:
    advances(env, CHECKPOINT_INTERVAL + 10, 120, "a checkpoint exists")
    old = uids(worker_pods(env.kube, env.ns, quick))
    at_loss = step(env)
    env.kubectl("delete", "pod", f"{quick}-worker-0", "-n", env.ns, "--wait=false")
    pods = wait_for(
        lambda: running_workers(env, 3, world=True, not_uid=old[f"{quick}-worker-0"]),
        RECOVER_TIMEOUT,
        "worker-0 replaced and a world of 3 again",
    )
    assert {n: u for n, u in uids(pods).items() if n != f"{quick}-worker-0"} == {
        n: u for n, u in old.items() if n != f"{quick}-worker-0"
    }, "only worker-0 replaced"
    advances(env, at_loss + 10, RECOVER_TIMEOUT, "training goes on after the loss")
    lost = wait_for(lambda: lost_steps(env, pods), 30, "the resumed rank 0's restart report")
    # Checkpoints are written in the background: a loss right after a checkpoint step, while that
    # checkpoint is still being written, falls back to the previous one. So the bound is one
    # interval plus the steps of one in-flight write, which is well under another interval here.
    assert all(n <= 2 * CHECKPOINT_INTERVAL for n in lost), (
        f"lost steps {lost} > interval {CHECKPOINT_INTERVAL} + one in-flight write"
    )
    wait_for(lambda: job_status(env.kube, env.ns, quick).get("phase") == "Running", 60, "phase Running again")


def test_6_kubectl_scale_changes_the_world_size(env: Env, quick: str) -> None:
    env.kubectl("scale", f"sgdjob/{quick}", "--replicas=2", "-n", env.ns)
    at_scale = step(env)
    pods = wait_for(lambda: running_workers(env, 2, world=True), RECOVER_TIMEOUT, "a world of 2 workers")
    assert sorted(uids(pods)) == [f"{quick}-worker-0", f"{quick}-worker-1"]
    advances(env, at_scale + 10, RECOVER_TIMEOUT, "training goes on at 2 workers")
    st = wait_for(
        lambda: (s := job_status(env.kube, env.ns, quick)).get("ready") == "2/2" and s, 60, "status ready 2/2"
    )
    assert st["replicas"] == 2 and (get_job(env.kube, env.ns, quick) or {})["spec"]["replicas"] == 2
    # The removed workers' pods take a while to go (kubelet v1.20.2 removes a deleted pod only after its
    # sandbox, devcluster/README.md); until then the job is Adapting ("worker pods terminating").
    wait_for(lambda: job_status(env.kube, env.ns, quick).get("phase") == "Running", 120, "phase Running at 2 workers")


def test_5_operator_crash_and_restart_creates_no_duplicates(env: Env, quick: str) -> None:
    st = job_status(env.kube, env.ns, quick)
    print(f"quick at step {st.get('step')} of {STEPS} when the operator is killed")  # sizes STEPS
    assert st["phase"] == "Running" and int(st["step"]) < STEPS, (
        "the job must still be running to test a mid-job operator crash"
    )
    every = f"/api/v1/namespaces/{env.ns}/pods"
    before = uids(env.kube.get(every)["items"])
    decisions = st.get("decisions") or []
    env.crash_operator(down_s=3)  # the job trains on without its operator
    # The restarted operator adopts the job: it scrapes and writes progress again.
    advances(env, step(env), 60, "status progress from the restarted operator")
    assert uids(env.kube.get(every)["items"]) == before, "same pods, none added or replaced"
    assert (job_status(env.kube, env.ns, quick).get("decisions") or []) == decisions


def test_1_5_job_finishes_succeeded(env: Env, quick: str) -> None:
    st = wait_for(
        lambda: (s := job_status(env.kube, env.ns, quick)).get("phase") == "Succeeded" and s, 600, f"{quick} Succeeded"
    )
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in st["conditions"])
    pods = worker_pods(env.kube, env.ns, quick)
    assert [p["metadata"]["name"] for p in pods] == [f"{quick}-worker-0", f"{quick}-worker-1"]
    assert all(p["status"]["phase"] == "Succeeded" for p in pods)
    (row,) = kubectl_table(env, "sgdjobs", "-n", env.ns)
    assert row["PHASE"] == "Succeeded" and int(row["STEP"]) == STEPS, row


def test_8_delete_removes_pods_service_and_secret(env: Env, quick: str) -> None:
    env.kubectl("delete", "sgdjob", quick, "-n", env.ns, "--wait=false")
    assert_children_gone(env.kube, env.ns, quick)
