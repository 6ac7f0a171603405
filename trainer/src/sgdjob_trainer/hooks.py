"""User hooks: `package.module:function` names a model, dataset or loss hook (models.py says what each
kind is called with and returns), resolved here for models.py and data.py."""

from __future__ import annotations

import importlib
from typing import Any


def load_hook(spec: str) -> Any:
    """Resolve `package.module:function` to the object it names."""
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise ValueError(f"hook '{spec}': module {module_name} has no attribute {attr}") from err
