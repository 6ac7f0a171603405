"""Generate the SGDJob CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema with $refs, anyOf-with-null and titles; a Kubernetes structural schema
wants every node inlined with a type, `nullable` instead of null unions, and no titles. This module
does that translation and nothing else.
"""

from __future__ import annotations

from typing import Any

import yaml

from sgdjob_operator.api.models import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION, SGDJobSpec, SGDJobStatus

_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "items",
    "properties",
    "required",
    "additionalProperties",
    "nullable",
    "format",
    "x-kubernetes-preserve-unknown-fields",
}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one resolved pydantic schema node into a structural OpenAPI v3 node."""
    node = dict(node)
    for union_key in ("anyOf", "oneOf"):
        if union_key in node:
            options = [o for o in node.pop(union_key) if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"cannot express a union of {len(options)} types structurally: {options}")
            outer = {k: v for k, v in node.items()}
            node = {**options[0], **outer, "nullable": True}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("default", "") is None:
        node.pop("default")
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        # JSON Schema 2020 gives a number; OpenAPI v3.0 (Kubernetes) wants the bound plus a flag.
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            node[flag] = node.pop(bound)
            node[bound] = True
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node.setdefault("type", "object")
        node.pop("additionalProperties", None)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue
        if key == "properties":
            out[key] = {name: _structural(child) for name, child in value.items()}
        elif key == "items":
            out[key] = _structural(value)
        elif key == "additionalProperties":
            if isinstance(value, dict) and "properties" not in node:
                out[key] = _structural(value)
        else:
            out[key] = value
    if "properties" in out:
        out.pop("additionalProperties", None)
        out["type"] = "object"
        if "default" in out:
            # The API server fills an object default's own fields from their defaults, so `{}`
            # suffices and keeps today's nested defaults out of the schema twice.
            out["default"] = {}
    if "nullable" in out and not out.get("nullable"):
        out.pop("nullable")
    return out


def model_schema(model: type[SGDJobSpec] | type[SGDJobStatus]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


def _drop_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for child in node.get("properties", {}).values():
        _drop_defaults(child)
    if isinstance(node.get("items"), dict):
        _drop_defaults(node["items"])


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
    {
        "name": "Mode",
        "type": "string",
        "jsonPath": ".status.modeSummary",
        "description": "Active synchronisation mode; '(rebalanced)' while the ranks' batch sizes differ.",
    },
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Ready/desired worker pods."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Latest optimizer step."},
    {
        "name": "Stragglers",
        "type": "integer",
        "jsonPath": ".status.stragglerCount",
        "description": "Ranks found slow now.",
    },
    {
        "name": "Target",
        "type": "string",
        "jsonPath": ".status.targetMode",
        "priority": 1,
        "description": "Mode being switched to.",
    },
    {
        "name": "Batches",
        "type": "string",
        "jsonPath": ".status.batches",
        "priority": 1,
        "description": "Per-rank batch sizes while they differ.",
    },
    {
        "name": "Loss",
        "type": "number",
        "jsonPath": ".status.loss",
        "priority": 1,
        "description": "Latest training loss.",
    },
    {
        "name": "Val-Loss",
        "type": "number",
        "jsonPath": ".status.validationLoss",
        "priority": 1,
        "description": "Latest validation loss (rank 0, held-out split).",
    },
    {
        "name": "Val-Acc",
        "type": "number",
        "jsonPath": ".status.validationAccuracy",
        "priority": 1,
        "description": "Latest validation accuracy (classification).",
    },
    {
        "name": "ETA",
        "type": "string",
        "jsonPath": ".status.eta",
        "description": "Predicted time left, from the measured pace and validation trend.",
    },
    {
        "name": "ETA-To",
        "type": "string",
        "jsonPath": ".status.etaBasis",
        "priority": 1,
        "description": "What ETA counts to: target or last step.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The SGDJob CRD as a dict (apiextensions.k8s.io/v1)."""
    spec_schema = model_schema(SGDJobSpec)
    status_schema = model_schema(SGDJobStatus)
    status_schema.pop("required", None)
    # Status belongs to the operator, which writes whole values; server-side defaults there would
    # only invent readings nobody made (and v1.20 mangles empty-string defaults into null).
    _drop_defaults(status_schema)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "An elastic PyTorch training job that adapts its synchronisation "
                                "(sync, hierarchical, async) to its workers' measured speed."
                            ),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": "sgdjob.dev/v1alpha1"},
                                "kind": {"type": "string", "description": "SGDJob"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as YAML, exactly as checked in under crds/."""
    header = "# Generated by `sgdjob crd` from the pydantic models; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
