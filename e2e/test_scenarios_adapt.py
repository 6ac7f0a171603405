"""Adaptation scenarios on real kubelet nodes with the Helm-installed operator (e2e/real.py): an
emulated straggler that appears mid-run makes the policy switch the mode (2); a straggler bound to one
node makes it replace the worker elsewhere (3). Compute is emulated (a per-rank sleep per step,
CPU-only machine); what is measured is the coordination. Each job is deleted at the end and must leave
nothing (scenario 8 on a running job).

Thresholds are set above this machine's noise (a loaded 2-core machine can make a healthy rank look
2x slow for a while) and the emulated slowdowns well above the thresholds, so only the emulated
straggler can trigger the policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from devcluster.realnodes import RealCluster
from devcluster.testing import Obj, wait_for
from e2e.helpers import (
    Env,
    assert_children_gone,
    job_events,
    job_status,
    worker_pods,
)
from e2e.real import OPERATOR_IMAGES, RealOperator, real_scenario_env

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=OPERATOR_IMAGES)]

START_TIMEOUT = 240.0
RECOVER_TIMEOUT = 240.0
INTERVAL, PERSISTENCE = 2, 2
# Noise guard: flag a rank only at 2.5x the median; the emulated stragglers are 6x.
POLICY = {
    "intervalSeconds": INTERVAL,
    "persistenceIntervals": PERSISTENCE,
    "cooldownSeconds": 30,
    "stragglerThreshold": 2.5,
    "recoverThreshold": 1.5,
}


@pytest.fixture(scope="module")
def env(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    with real_scenario_env(real_cluster, real_operator, "adapt", tmp_path_factory.mktemp("adapt")) as e:
        yield e


@pytest.fixture(autouse=True)
def _nothing_left(env: Env) -> Iterator[None]:
    """A scenario that fails midway still frees the nodes' GPUs for the next one."""
    yield
    env.kubectl("delete", "sgdjobs", "--all", "-n", env.ns, "--wait=false", check=False)
    wait_for(lambda: not env.kube.get(f"/api/v1/namespaces/{env.ns}/pods")["items"], 90, f"pods in {env.ns} gone")


def live_workers(e: Env, job: str, n: int) -> list[Obj] | None:
    pods = [p for p in worker_pods(e.kube, e.ns, job) if not p["metadata"].get("deletionTimestamp")]
    return (
        pods
        if len(pods) == n and all(p["status"].get("phase") == "Running" and p["status"].get("podIP") for p in pods)
        else None
    )


@dataclass
class Reading:
    time: float
    samples: int  # samples applied, summed over the ranks (each trainer's /status counter)
    step: int
    modes: frozenset[str]
    by_rank: dict[int, int]  # each rank's own samples applied


@dataclass
class Meter:
    """Reads every worker's /status (as `curl <pod>:9400/status` would): samples applied, step, mode."""

    env: Env
    pods: list[Obj]
    readings: list[Reading] = field(default_factory=list)

    def read(self) -> Reading | None:
        docs = [self.env.pod_json(p, 9400, "/status") for p in self.pods]
        if not all(docs):
            return None
        ok = [d for d in docs if d]
        r = Reading(
            time.monotonic(),
            sum(int(d["samples"]) for d in ok),
            max(int(d["step"]) for d in ok),
            frozenset(str(d["mode"]) for d in ok),
            {int(d["rank"]): int(d["samples"]) for d in ok},
        )
        self.readings.append(r)
        return r

    def until(self, done: Callable[[Reading], bool], timeout: float, what: str) -> Reading:
        """Read every 0.3 s until a reading satisfies `done`."""

        def check() -> Reading | None:
            r = self.read()
            return r if r is not None and done(r) else None

        return wait_for(check, timeout, what)

    def window(self, start: float, end: float) -> tuple[Reading, Reading]:
        """The first reading at or after `start` and the last at or before `end`."""
        inside = [r for r in self.readings if start <= r.time <= end]
        assert len(inside) >= 2 and inside[-1].time - inside[0].time >= 1.0, (
            f"too few readings in [{start:.1f}, {end:.1f}]"
        )
        return inside[0], inside[-1]

    def rate(self, start: float, end: float) -> float:
        """Samples/s, summed over the ranks, between `start` and `end`."""
        a, b = self.window(start, end)
        return (b.samples - a.samples) / (b.time - a.time)

    def gains(self, start: float, end: float) -> dict[int, int]:
        """Each rank's samples applied between `start` and `end`."""
        a, b = self.window(start, end)
        return {rank: b.by_rank[rank] - a.by_rank.get(rank, 0) for rank in b.by_rank}


def test_2_straggler_mid_run_switches_mode_and_throughput_rises(env: Env) -> None:
    job, onset_step = "strag", 150
    slow = {"rank": 2, "factor": 6.0, "startStep": onset_step}
    manifest = env.manifest(
        job,
        steps=100_000,
        checkpoint_dir=str(env.tmp / job),
        # 0.1 s of emulated compute (a sleep): a fast rank's real CPU work per step (its model, the
        # parameter server's update) stays small beside it, so CPU taken by whatever else runs on the two
        # cores (CI runs the other half of the suite beside this one) slows async's fast ranks little.
        emulation={"computeSeconds": 0.1, "slowdowns": [slow]},
        policy={**POLICY, "allowedActions": ["switchMode"]},
    )
    env.apply(manifest)
    pods = wait_for(lambda: live_workers(env, job, 3), START_TIMEOUT, f"{job}: 3 running workers")
    meter = Meter(env, pods)
    first = meter.until(lambda r: r.step > 0, START_TIMEOUT, f"{job} training")
    assert first.step < onset_step, (
        f"training reached step {first.step} before the test saw it start; raise the onset step"
    )
    onset = meter.until(lambda r: r.step >= onset_step, 120, f"{job} at step {onset_step}")
    assert onset.modes == {"sync"} and not job_status(env.kube, env.ns, job).get("decisions"), (
        "no change before the straggler appears"
    )
    # Until every worker runs async: the switch, as the workers see it.
    switched = meter.until(lambda r: r.modes == {"async"}, 60, f"{job} switched to async")
    bound = (PERSISTENCE + 2) * INTERVAL + 15  # detection window + persistence + a pass + slack for a loaded machine
    assert switched.time - onset.time <= bound, (
        f"switch {switched.time - onset.time:.1f}s after the onset, bound {bound}s"
    )
    st = wait_for(
        lambda: (s := job_status(env.kube, env.ns, job)).get("mode") == "async" and s, 30, "status.mode async"
    )
    (decision,) = st["decisions"]
    assert decision["action"] == "switchMode" and decision["mode"] == "async" and "rank 2" in decision["reason"], (
        decision
    )
    reasons = [ev["reason"] for ev in job_events(env.kube, env.ns, job)]
    assert "SwitchMode" in reasons and "ModeSwitched" in reasons, reasons
    # Throughput with the straggler before the switch vs after it (the switch's own pause excluded), over
    # 20 s so that a spike of load elsewhere on the machine weighs less.
    deadline = switched.time + 20
    while time.monotonic() < deadline:
        meter.read()
        time.sleep(0.3)
    before = meter.rate(onset.time, switched.time - 0.5)
    after = meter.rate(switched.time + 1.0, deadline)
    # What async is for: the fast ranks no longer wait for the straggler (6x slower, so up to 6x its samples).
    # Also fails if the policy leaves async within the window: two CI runs measured 192 against 173 and
    # 208 against 165 samples/s when it read a correlation of 0 off noisy async lags and went back to sync.
    gains = meter.gains(switched.time + 1.0, deadline)
    fast = min(g for rank, g in gains.items() if rank != 2)
    assert fast >= 2 * gains[2], f"after the switch the straggler (rank 2) applied {gains[2]} samples of {gains}"
    assert after > 1.3 * before, f"throughput after the switch {after:.0f} samples/s is not above {before:.0f} before"
    st = job_status(env.kube, env.ns, job)
    assert st.get("mode") == "async" and len(st["decisions"]) == 1, ("async left with the straggler there", st)
    env.kubectl("delete", "sgdjob", job, "-n", env.ns, "--wait=false")
    assert_children_gone(env.kube, env.ns, job)


def test_3_node_bound_straggler_is_replaced_on_another_node(env: Env) -> None:
    job, bad_node = "nodeslow", "node-1"
    # One GPU per worker spreads the three over the GPU nodes; preferring node-1 puts one of them there.
    prefer = {
        "weight": 100,
        "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [bad_node]}]},
    }
    spec = {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [prefer]}}}
    template = {"spec": {**spec, "containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    emulation = {"computeSeconds": 0.04, "slowdowns": [{"node": bad_node, "factor": 6.0}]}
    manifest = env.manifest(
        job,
        steps=100_000,
        checkpoint_dir=str(env.tmp / job),
        emulation=emulation,
        template=template,
        policy={**POLICY, "allowedActions": ["replaceWorker"]},
    )
    env.apply(manifest)
    pods = wait_for(lambda: live_workers(env, job, 3), START_TIMEOUT, f"{job}: 3 running workers")
    (slow,) = [p for p in pods if p["spec"]["nodeName"] == bad_node]
    slow_name, slow_uid = slow["metadata"]["name"], slow["metadata"]["uid"]

    def replaced() -> Obj | None:
        ps = live_workers(env, job, 3)
        new = next(
            (p for p in ps or [] if p["metadata"]["name"] == slow_name and p["metadata"]["uid"] != slow_uid), None
        )
        return new

    new = wait_for(replaced, RECOVER_TIMEOUT, f"{slow_name} replaced")
    assert new["spec"]["nodeName"] != bad_node
    st = job_status(env.kube, env.ns, job)
    excluded = [e["node"] for e in (st.get("controller") or {}).get("excludedNodes", [])]
    assert bad_node in excluded, st.get("controller")
    assert any(d["action"] == "replaceWorker" for d in st["decisions"]), st["decisions"]
    assert any(
        ev["reason"] == "ReplaceWorker" and bad_node in ev["message"] for ev in job_events(env.kube, env.ns, job)
    )
    terms = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert all({"key": "metadata.name", "operator": "NotIn", "values": [bad_node]} in t["matchFields"] for t in terms)

    # Training goes on in a world of 3 with no rank on the slow node.
    def training_again() -> list[Obj] | None:
        docs = [env.pod_json(p, 9400, "/status") for p in live_workers(env, job, 3) or []]
        good = [d for d in docs if d and d.get("worldSize") == 3 and int(d.get("step", 0)) > 0]
        return good if len(good) == 3 else None

    docs = wait_for(training_again, RECOVER_TIMEOUT, f"{job} training again with 3 workers")
    assert bad_node not in {d["node"] for d in docs}
    # The operator named the replaced pod's agent to the store before deleting it, so its peers dropped
    # it at once instead of waiting for its heartbeats to lapse.
    said = "\n".join(env.logs(p["metadata"]["name"]) for p in live_workers(env, job, 3) or [])
    assert "was removed by the job's controller: off the rendezvous" in said, said[-3000:]

    # What the replacement paused is measured (k8s.restart_cost), from the decision until every rank of
    # the new world trained, and kept in status: the next membership change is weighed by it.
    def measured() -> Obj | None:
        ctl = job_status(env.kube, env.ns, job).get("controller") or {}
        return ctl if ctl.get("restartSeconds") and not ctl.get("restartFrom") else None

    ctl = wait_for(measured, 60, f"{job}: the replacement's restart measured")
    assert 1.0 <= ctl["restartSeconds"] < RECOVER_TIMEOUT, ctl
    env.kubectl("delete", "sgdjob", job, "-n", env.ns, "--wait=false")
    assert_children_gone(env.kube, env.ns, job)
