"""Spec validation: the rules a user meets in `sgdjob validate`, the operator and the webhook."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sgdjob_operator.api.models import JobMode, SGDJob
from sgdjob_operator.api.validation import SpecError, validate_job, validate_spec
from sgdjob_operator.cli import main
from sgdjob_trainer.config import SyncMode, initial_batches

ROOT = Path(__file__).resolve().parents[2]


def _doc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob", "metadata": {"name": "t"}, "spec": spec}


def _problems(**spec: Any) -> list[str]:
    with pytest.raises(SpecError) as err:
        validate_job(_doc(**spec))
    return err.value.problems


def test_defaults_make_a_runnable_job() -> None:
    job = validate_job(_doc())
    assert job.spec.replicas == 1 and job.spec.min_workers == 1 and job.spec.max_workers == 1
    assert job.spec.mode is JobMode.AUTO and job.spec.initial_mode is SyncMode.SYNC
    assert job.spec.training.batch_size == 32 and job.spec.training.emulation is None


def test_min_and_max_default_to_replicas_and_bound_it() -> None:
    spec = validate_spec({"replicas": 4, "maxReplicas": 6})
    assert (spec.min_workers, spec.max_workers, spec.max_world_size) == (4, 6, 6)
    assert _problems(replicas=4, minReplicas=5) == [
        "spec.minReplicas: minReplicas (5) must be <= replicas (4): lower minReplicas or raise replicas"
    ]
    assert _problems(replicas=4, maxReplicas=3)[0].startswith(
        "spec.maxReplicas: maxReplicas (3) must be >= replicas (4)"
    )


@pytest.mark.parametrize(
    ("spec", "prefix"),
    [
        ({"mode": "fast"}, "spec.mode: Input should be"),
        ({"replicas": 0}, "spec.replicas: Input should be greater than or equal to 1"),
        ({"replicas": 1.5}, "spec.replicas:"),
        ({"replica": 3}, "spec.replica: unknown field"),
        ({"training": {"learningRate": -1}}, "spec.training.learningRate: Input should be greater than 0"),
        ({"training": {"model": "not a hook"}}, "spec.training.model: 'not a hook' is neither a built-in"),
        (
            {"training": {"dataset": "mypkg.data:load"}, "policy": {"recoverThreshold": 1.6}},
            "spec.policy.recoverThreshold: recoverThreshold (1.6) must be below",
        ),
        (
            {"policy": {"allowedActions": ["rescale"]}},
            "spec.policy.allowedActions: rescale is allowed but minReplicas == maxReplicas",
        ),
        (
            {"policy": {"allowedActions": ["rebalance", "rebalance"]}},
            "spec.policy.allowedActions: list each action at most once",
        ),
        (
            {"replicas": 2, "training": {"emulation": {"slowdowns": [{"rank": 2}]}}},
            "spec.training.emulation.slowdowns[0].rank: rank 2 does not exist",
        ),
        (
            {"training": {"emulation": {"slowdowns": [{"factor": 2}]}}},
            "spec.training.emulation.slowdowns[0].rank: give exactly one of rank or node",
        ),
        (
            {"training": {"emulation": {"slowdowns": [{"rank": 0, "startStep": 5, "endStep": 5}]}}},
            "spec.training.emulation.slowdowns[0].endStep:",
        ),
        (
            {"replicas": 2, "training": {"hierarchical": {"groups": [[0], [0, 1]]}}},
            "spec.training.hierarchical.groups[1]: rank 0 is negative or in two groups",
        ),
        (
            {"replicas": 2, "training": {"hierarchical": {"groups": [[0], [1, 2]]}}},
            "spec.training.hierarchical.groups[1]: rank 2 does not exist",
        ),
        ({"training": {"evaluation": {"samples": 0}}}, "spec.training.evaluation.samples: Input should be greater"),
        ({"training": {"evaluation": {"everySteps": 0}}}, "spec.training.evaluation.everySteps: Input should be"),
        ({"training": {"evaluation": {"everySeconds": 0}}}, "spec.training.evaluation.everySeconds: Input should be"),
        ({"training": {"target": {"metric": "f1", "value": 1}}}, "spec.training.target.metric: Input should be"),
        ({"training": {"target": {"metric": "loss"}}}, "spec.training.target.value: Field required"),
        (
            {"training": {"dataset": "digits", "target": {"metric": "accuracy", "value": 90}}},
            "spec.training.target.value: an accuracy target must be in (0, 1]",
        ),
        (
            {"training": {"target": {"metric": "accuracy", "value": 0.9}}},
            "spec.training.target.metric: an accuracy target needs a classification",
        ),
        (
            {"training": {"target": {"metric": "loss", "value": 0.1}, "evaluation": {"everySteps": None}}},
            "spec.training.evaluation.everySteps: a target needs periodic validation",
        ),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], prefix: str) -> None:
    problems = _problems(**spec)
    assert any(p.startswith(prefix) for p in problems), problems


def test_world_size_counts_processes_per_node() -> None:
    validate_spec({"replicas": 2, "nprocPerNode": 4, "training": {"emulation": {"slowdowns": [{"rank": 7}]}}})


def test_wrong_kind_and_missing_spec() -> None:
    with pytest.raises(SpecError, match="kind: kind must be SGDJob"):
        validate_job({**_doc(), "kind": "PyTorchJob"})
    with pytest.raises(SpecError, match="spec: missing"):
        validate_job({"apiVersion": "sgdjob.dev/v1alpha1", "kind": "SGDJob"})


def test_round_trip_keeps_camel_case() -> None:
    job = validate_job(_doc(replicas=3, maxReplicas=5, training={"async": {"staleness": None}}))
    dumped = job.model_dump(by_alias=True, mode="json")
    assert dumped["spec"]["maxReplicas"] == 5 and "async" in dumped["spec"]["training"]
    assert SGDJob.model_validate(dumped).spec == job.spec


def test_cli_validate_examples_and_bad_file(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", *map(str, sorted((ROOT / "examples").glob("*.yaml")))])
    assert ok.exit_code == 0, ok.output
    assert "quickstart is valid" in ok.output and "resnet-mixed-fleet is valid" in ok.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: sgdjob.dev/v1alpha1\nkind: SGDJob\nmetadata: {name: b}\nspec: {replicas: 2, minReplicas: 3}\n"
    )
    result = runner.invoke(main, ["validate", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}: spec.minReplicas: minReplicas (3) must be <= replicas (2)" in result.output
    garbage = tmp_path / "garbage.yaml"
    garbage.write_text("spec: [unclosed\n")
    result = runner.invoke(main, ["validate", str(garbage)])
    assert result.exit_code == 1 and "not valid YAML" in result.output


def test_quickstart_is_the_documented_shape() -> None:
    (job,) = [
        validate_job(d) for d in __import__("yaml").safe_load_all((ROOT / "examples/quickstart.yaml").read_text())
    ]
    emulation = job.spec.training.emulation
    assert job.spec.replicas * job.spec.nproc_per_node == 4 and job.spec.mode is JobMode.AUTO
    assert emulation is not None and [(s.rank, s.factor) for s in emulation.slowdowns] == [(3, 3.0)]


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (None, "missing"),
        ("My_Job", "not a DNS-1123 name"),
        ("job-", "not a DNS-1123 name"),
        ("9lives", "start with a letter"),
        ("team.job", "start with a letter and leave out '.'"),
        ("j" * 52, "at most 51"),
    ],
)
def test_a_name_kubectl_apply_or_the_operator_would_refuse_is_refused_naming_metadata_name(
    name: str | None, says: str
) -> None:
    doc = {**_doc(), "metadata": {} if name is None else {"name": name}}
    with pytest.raises(SpecError) as err:
        validate_job(doc)
    (problem,) = err.value.problems
    assert problem.startswith("metadata.name: ") and says in problem


def test_names_that_fit_every_derived_object_pass_and_generate_name_is_checked_as_generated() -> None:
    for name in ("j", "mnist-ddp-2", "j" * 51):
        validate_job({**_doc(), "metadata": {"name": name}})
    validate_job({**_doc(), "metadata": {"generateName": "sweep-"}})
    with pytest.raises(SpecError, match=r"metadata\.name"):
        validate_job({**_doc(), "metadata": {"generateName": "Sweep-"}})


def test_validate_cli_reports_a_bad_name_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: sgdjob.dev/v1alpha1\nkind: SGDJob\nmetadata: {name: Quick_Start}\nspec: {replicas: 2}\n"
    )
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 1
    assert "metadata.name: 'Quick_Start' is not a DNS-1123 name" in result.output


def test_a_static_split_is_for_mode_sync_with_one_batch_per_rank() -> None:
    split = {"rankBatchSizes": [40, 40, 16]}
    job = validate_job(_doc(replicas=3, mode="sync", training=split))
    assert job.spec.training.rank_batch_sizes == [40, 40, 16]
    assert initial_batches(job.spec.training, 3) == {0: 40, 1: 40, 2: 16}
    assert initial_batches(job.spec.training, 2) == {}  # another world: every rank takes batchSize
    (auto,) = _problems(replicas=3, training=split)
    assert auto.startswith("spec.training.rankBatchSizes: a static split is for mode sync, not auto")
    (count,) = _problems(replicas=2, nprocPerNode=2, mode="sync", training=split)
    assert count == (
        "spec.training.rankBatchSizes: 3 batch sizes for 4 processes (replicas x nprocPerNode): give one per rank"
    )


def test_run_refuses_a_mode_override_of_a_static_split(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: sgdjob.dev/v1alpha1\nkind: SGDJob\nmetadata: {name: lb}\n"
        "spec: {replicas: 2, mode: sync, training: {rankBatchSizes: [40, 24]}}\n"
    )
    result = CliRunner().invoke(main, ["run", str(path), "--mode", "auto"])
    assert result.exit_code == 2 and "spec.training.rankBatchSizes is a static split for mode sync" in result.output
