"""One validation path for the CLI, the operator and the admission webhook.

Errors name the field as a user writes it (`spec.minReplicas`), so the same message reads right
in `sgdjob validate`, in a Failed condition and in a webhook rejection. Warnings (`spec_warnings`)
are read the same way but refuse nothing: a spec that is allowed yet will not do what it seems to
ask, printed by `sgdjob validate` and `sgdjob run` and posted by the operator as a Warning Event.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import ValidationError

from sgdjob_operator.api.models import JobMode, SGDJob, SGDJobSpec
from sgdjob_operator.api.names import name_problem


class SpecError(ValueError):
    """A spec that fails validation; `problems` are 'field: message' lines."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in problems))


def _path(parts: Iterable[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def format_errors(err: ValidationError, root: str = "") -> list[str]:
    """Turn pydantic errors into 'field: message' lines with camelCase paths."""
    lines: list[str] = []
    for item in err.errors():
        loc: list[str | int] = [root] if root else []
        # pydantic puts the failing union/variant name into loc for some errors; drop those.
        loc += [p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        ctx = item.get("ctx") or {}
        if item["type"] == "cross_field" and ctx.get("field"):
            loc += [p for p in str(ctx["field"]).split(".") if p]
            message = str(ctx["message"])
        elif item["type"] == "extra_forbidden":
            message = "unknown field: remove it or check its spelling (fields are camelCase)"
        else:
            message = item["msg"]
        lines.append(f"{_path(loc) or '(document)'}: {message}")
    return lines


def validate_job(doc: dict[str, Any], source: str = "") -> SGDJob:
    """Validate a whole SGDJob document; raise SpecError naming each bad field."""
    if not isinstance(doc, dict):
        raise SpecError(["(document): expected a mapping with apiVersion, kind, metadata and spec"], source)
    if "spec" not in doc:
        raise SpecError(["spec: missing; an SGDJob needs a spec (see examples/quickstart.yaml)"], source)
    try:
        job = SGDJob.model_validate(doc)
    except ValidationError as err:
        problems = format_errors(err)
        if (name := document_name_problem(doc)) is not None:
            problems.insert(0, name)
        raise SpecError(problems, source) from err
    if (name := document_name_problem(doc)) is not None:
        raise SpecError([name], source)
    return job


def document_name_problem(doc: dict[str, Any]) -> str | None:
    """'metadata.name: why' when the document's name is one kubectl apply or the operator would refuse."""
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        return "metadata: missing; give the job a name (metadata: {name: my-job}), as kubectl apply requires"
    generated = meta.get("generateName")
    # The API server appends five characters to a generateName; check the name it would make.
    problem = name_problem(meta.get("name") or (f"{generated}x0000" if generated else None))
    return None if problem is None else f"metadata.name: {problem}"


def validate_spec(spec: dict[str, Any]) -> SGDJobSpec:
    """Validate a spec alone (as the operator receives it); paths start with 'spec'."""
    try:
        return SGDJobSpec.model_validate(spec)
    except ValidationError as err:
        raise SpecError(format_errors(err, root="spec")) from err


MODE_NOT_ADJUSTABLE = "ModeNotAdjustable"
# Every reason spec_warnings gives: the operator forgets one that no longer applies, to warn again if it returns.
WARNING_REASONS = (MODE_NOT_ADJUSTABLE,)


class SpecWarning(NamedTuple):
    reason: str  # the Warning Event's reason on Kubernetes: one Event per reason
    message: str  # 'field: message', as an error line reads


def spec_warnings(spec: SGDJobSpec, mode_field: str = "spec.mode") -> list[SpecWarning]:
    """What the spec asks for but will not get; never a reason to refuse it. `mode_field` names
    where the mode came from (`--mode` when `sgdjob run` overrides spec.mode)."""
    warnings: list[SpecWarning] = []
    if spec.mode is JobMode.AUTO and not spec.training.reports:
        # The policy acts through the trainer's reports and /control; a command-mode script has
        # neither, so `auto` would silently mean "never adapt" (the script runs as written).
        warnings.append(
            SpecWarning(
                MODE_NOT_ADJUSTABLE,
                f"{mode_field}: auto cannot adapt spec.training.command: the policy switches modes and "
                "rebalances only a trainer that reports to SGDJob, and a command-mode script does not, so it "
                f"runs as written; set {mode_field} to sync, or give your model as spec.training.task or put "
                "your script on the adaptation API (spec.training.adaptation: api) to let the policy adapt it",
            )
        )
    return warnings


def load_jobs(path: Path) -> list[SGDJob]:
    """Read every SGDJob document of a YAML file; raise SpecError on the first bad one."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError([f"(document): not valid YAML: {err}"], str(path)) from err
    if not docs:
        raise SpecError(["(document): the file holds no document"], str(path))
    return [validate_job(doc, str(path)) for doc in docs]
