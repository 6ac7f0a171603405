"""One validation path for the CLI, the operator and the admission webhook.

Errors name the field as a user writes it (`spec.minReplicas`), so the same message reads right
in `sgdjob validate`, in a Failed condition and in a webhook rejection.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sgdjob_operator.api.models import SGDJob, SGDJobSpec
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


def load_jobs(path: Path) -> list[SGDJob]:
    """Read every SGDJob document of a YAML file; raise SpecError on the first bad one."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError([f"(document): not valid YAML: {err}"], str(path)) from err
    if not docs:
        raise SpecError(["(document): the file holds no document"], str(path))
    return [validate_job(doc, str(path)) for doc in docs]
