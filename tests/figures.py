"""Measured figures a test module wants in CI's log even when it passes (pytest shows no captured
output then): title -> text, printed by the root conftest.py at the end of the session."""

from __future__ import annotations

FIGURES: dict[str, str] = {}
