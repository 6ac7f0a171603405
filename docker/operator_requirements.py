"""Print the operator image's requirements: the package's runtime dependencies minus the trainer-only ones.

The operator never imports torch, scikit-learn, matplotlib or numpy (it reads the trainer's
torch-free config module only; plots and the simulator load theirs when used), so its image
installs the wheel with --no-deps plus this list. Reading
pyproject.toml keeps one dependency list; a test runs this script the way the Dockerfile does.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

TRAINER_ONLY = {"torch", "scikit-learn", "matplotlib", "numpy"}


def operator_requirements(pyproject: Path) -> list[str]:
    deps: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() not in TRAINER_ONLY]


if __name__ == "__main__":
    print("\n".join(operator_requirements(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
