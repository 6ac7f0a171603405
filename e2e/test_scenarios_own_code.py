"""Training code of the user's own on real nodes: an AdamW digits job that the user moves through every
mode with `kubectl patch` (sync -> async -> hierarchical -> auto) and that ends at its accuracy target,
with AdamW's state carried through every switch (the loss never jumps back); and the character-level
transformer example (examples/custom-task) through every mode too, from the image its README builds
(its Dockerfile on top of the trainer image, built here with buildah and imported into every node).
Compute is emulated (CPU-only machine)."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from collections.abc import Iterator

import pytest
import torch
import yaml

from devcluster.images import ImageBuilder
from devcluster.realnodes import RealCluster
from devcluster.testing import Obj, wait_for
from e2e.helpers import job_events, job_status
from e2e.real import OPERATOR_IMAGES, RealEnv, RealOperator, real_scenario_env
from tests.local.example_runs import REPO

pytestmark = [pytest.mark.k8s, pytest.mark.multiproc, pytest.mark.realnode(images=[*OPERATOR_IMAGES, "charlm"])]

START_TIMEOUT = 240.0
EXAMPLE = REPO / "examples" / "custom-task"


@pytest.fixture(scope="module")
def env(
    real_cluster: RealCluster, real_operator: RealOperator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealEnv]:
    with real_scenario_env(real_cluster, real_operator, "owncode", tmp_path_factory.mktemp("owncode")) as e:
        yield e


@pytest.fixture(scope="module")
def charlm_image(real_cluster: RealCluster) -> str:
    """The example's image (`sgdjob/charlm-trainer:dev`), built as its README says and in every node."""
    image = ImageBuilder().example("charlm")
    real_cluster.import_images([image])
    return image.ref


def unigram_bits() -> float:
    """Bits per character, on the example's held-out text, of the best model that ignores context: the
    training text's character frequencies (4.56 on Python 3.11's library, which the pod's image runs
    too). A model below it has learned from the characters before each one."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        data = importlib.import_module("charlm.data")
    finally:
        sys.path.remove(str(EXAMPLE))
    train, held_out = data.split_files(data.source_files())
    counts = torch.bincount(data.encode(data.read_text(train, data.TRAIN_CHARS)), minlength=data.VOCAB_SIZE)
    frequency = (counts.double() + 1.0) / float(counts.sum() + data.VOCAB_SIZE)
    ids = data.encode(data.read_text(held_out, data.VALIDATION_CHARS))
    return float(-frequency.log2()[ids].mean())


def _patch_mode(e: RealEnv, job: str, mode: str) -> None:
    patch = json.dumps({"spec": {"mode": mode}})
    e.kubectl("patch", "sgdjob", job, "-n", e.ns, "--type", "merge", "-p", patch)


def _finished(e: RealEnv, job: str) -> Obj | None:
    st = job_status(e.kube, e.ns, job)
    return st if st.get("phase") in ("Succeeded", "Failed") else None


def _validation_loss(e: RealEnv, job: str) -> float:
    return float(job_status(e.kube, e.ns, job).get("validationLoss") or "inf")


def walk_modes(e: RealEnv, job: str, steps_each: int) -> list[float]:
    """As a user would: `kubectl patch` the job from sync through async and hierarchical to auto,
    each mode for `steps_each` steps once the workers run it; the validation loss at each change."""
    wait_for(lambda: job_status(e.kube, e.ns, job).get("step", 0) > 2 * steps_each, START_TIMEOUT, f"{job} training")
    losses = [_validation_loss(e, job)]
    for mode in ("async", "hierarchical"):
        _patch_mode(e, job, mode)
        wait_for(lambda m=mode: job_status(e.kube, e.ns, job).get("mode") == m, 90, f"{job} runs {mode}")  # type: ignore[misc]
        start = job_status(e.kube, e.ns, job).get("step", 0)
        wait_for(
            lambda s=start: job_status(e.kube, e.ns, job).get("step", 0) > s + steps_each,  # type: ignore[misc]
            120,
            f"{job} {steps_each} steps in {mode}",
        )
        losses.append(_validation_loss(e, job))
    _patch_mode(e, job, "auto")
    return losses


def test_9_an_adamw_job_runs_in_every_mode_and_reaches_its_target(env: RealEnv) -> None:
    job = "adamw"
    training = {
        "model": "digits-mlp",
        "dataset": "digits",
        "optimizer": {"name": "adamw", "betas": [0.9, 0.98], "weightDecay": 0.05},
        "learningRate": 0.0007,  # slow enough that the target waits for every mode
        "steps": 20_000,
        "evaluation": {"everySteps": 20, "samples": 200},
        "target": {"metric": "accuracy", "value": 0.95},
    }
    manifest = env.manifest(
        job,
        steps=20_000,
        checkpoint_dir=str(env.tmp / job),
        mode="sync",
        emulation={"computeSeconds": 0.03},
        training=training,
    )
    env.apply(manifest)
    losses = walk_modes(env, job, steps_each=20)
    st = wait_for(lambda: _finished(env, job), 300, f"{job} finished")
    assert st["phase"] == "Succeeded", st.get("conditions")
    reasons = [ev["reason"] for ev in job_events(env.kube, env.ns, job)]
    assert reasons.count("ModeSwitched") >= 2, reasons
    # The final validation comes a few steps after the one that reached the target.
    assert st["targetStep"] > 0 and st["validationAccuracy"] >= 0.9, st
    # AdamW's moments go with every switch: no switch sets the validation loss back.
    losses.append(float(st["validationLoss"]))
    assert all(b < a * 1.25 for a, b in itertools.pairwise(losses)), losses


# Three transformer workers on CI's two cores beside the other tests: 170-590 s (stop 26's CI hit 600).
@pytest.mark.timeout(1200)
def test_10_the_transformer_example_runs_in_every_mode(env: RealEnv, charlm_image: str) -> None:
    """The example's job as it ships (task, AdamW, schedule, metric, policy), shortened to 300 steps
    on 3 workers with the third 3x slower, walked through sync, async, hierarchical and auto; bits
    per character must fall below what the characters' frequencies alone give (`unigram_bits`: a
    uniform guess is 7). Measured after the walk: 3.29 and 3.63 (ci60; the auto phase's path depends
    on the policy's timing on unequal nodes); the full run's bound is in the example's README."""
    job = "charlm"
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())["spec"]
    training = {**spec["training"], "steps": 300}
    emulation = {"computeSeconds": 0.03, "slowdowns": [{"rank": 2, "factor": 3.0}]}
    template = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": charlm_image,  # the module comes with the image, nothing from the host
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                }
            ]
        }
    }
    manifest = env.manifest(
        job,
        steps=300,
        checkpoint_dir=str(env.tmp / job),
        mode="sync",
        training={k: v for k, v in training.items() if k not in ("checkpoint", "emulation")},
        emulation=emulation,
        policy=spec["policy"],
        template=template,
    )
    env.apply(manifest)
    walk_modes(env, job, steps_each=30)
    st = wait_for(lambda: _finished(env, job), 1000, f"{job} finished")
    assert st["phase"] == "Succeeded", st.get("conditions")
    bits = float(st["validationMetric"])
    assert bits < unigram_bits(), f"{bits:.3f} bits per character: no better than character frequencies; {st}"
