"""The CRD is generated from the models: no drift, and structural with documented, bounded fields."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner

from sgdjob_operator.api.crd import build_crd, render_crd
from sgdjob_operator.cli import main

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "sgdjobs.sgdjob.dev.yaml"


def _walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_checked_in_crd_matches_the_models() -> None:
    assert CRD_FILE.read_text() == render_crd(), "crds/ is stale: run `sgdjob crd > crds/sgdjobs.sgdjob.dev.yaml`"
    assert CliRunner().invoke(main, ["crd"]).output == render_crd()


def test_schema_is_structural_documented_and_bounded() -> None:
    for path, node in _walk(_schema()["properties"]["spec"], "spec"):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert path.endswith("[]") or node.get("description"), f"{path} has no description"
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "const"} & node.keys(), f"{path} is not structural"
        if node.get("type") in ("integer", "number"):
            assert "minimum" in node and "maximum" in node, f"{path} lacks a minimum or maximum"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, path


def test_every_numeric_bound_fits_an_int64() -> None:
    # The API server checks an integral value (a loss of exactly 0) against a number's bounds as int64;
    # a bound beyond that range overflows into a rule that rejects every status write.
    limit = 2**63 - 1
    for part in ("spec", "status"):
        for path, node in _walk(_schema()["properties"][part], part):
            for key in ("minimum", "maximum"):
                if key in node:
                    assert -limit <= node[key] <= limit, f"{path}.{key} = {node[key]} overflows int64"


def test_enums_defaults_and_subresources() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["mode"]["enum"] == ["auto", "sync", "hierarchical", "async"] and spec["mode"]["default"] == "auto"
    assert spec["training"]["properties"]["async"]["properties"]["stalenessLr"]["enum"] == ["none", "inverse", "sqrt"]
    assert spec["template"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["training"]["properties"]["learningRate"]["exclusiveMinimum"] is True
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    names = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0]
    assert names == ["Phase", "Mode", "Ready", "Step", "Stragglers", "ETA", "Age"]
    assert yaml.safe_load(CRD_FILE.read_text())["spec"]["names"]["shortNames"] == ["sgdj"]


def test_chart_ships_the_same_crd() -> None:
    chart_crd = ROOT / "charts" / "sgdjob-operator" / "crds" / "sgdjobs.sgdjob.dev.yaml"
    assert chart_crd.read_text() == render_crd(), "chart CRD is stale: run `make crd`"
