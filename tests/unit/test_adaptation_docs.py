"""The adaptation API's documented diff is the diff of the two example scripts: the docs page and the
example's README show what a script really adds, not what it once added."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "examples/ddp-script/train.py"
AFTER = "examples/ddp-script-adapt/train.py"


def _code(path: str) -> list[str]:
    """The script without its module docstring (each example's own description)."""
    return (ROOT / path).read_text().split('"""', 2)[2].splitlines()


def script_diff() -> str:
    return "\n".join(difflib.unified_diff(_code(BEFORE), _code(AFTER), BEFORE, AFTER, n=1, lineterm=""))


@pytest.mark.parametrize("doc", ["docs/adaptation-api.md", "examples/ddp-script-adapt/README.md"])
def test_the_documented_diff_is_the_examples_diff(doc: str) -> None:
    text = (ROOT / doc).read_text()
    shown = text.split("```diff\n", 1)[1].split("\n```", 1)[0]
    assert shown == script_diff(), f"{doc}: regenerate its diff block from tests/unit/test_adaptation_docs.py"
    assert "session.step(loss)" in shown and "adapt.start(" in shown
