"""The three synchronisation modes behind one interface (strategies.base.Strategy)."""

from __future__ import annotations

from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.strategies.async_ps import AsyncStrategy
from sgdjob_trainer.strategies.base import Context, StepResult, Strategy
from sgdjob_trainer.strategies.hierarchical import HierarchicalStrategy
from sgdjob_trainer.strategies.sync import SyncStrategy

STRATEGIES: dict[SyncMode, type[Strategy]] = {
    SyncMode.SYNC: SyncStrategy,
    SyncMode.HIERARCHICAL: HierarchicalStrategy,
    SyncMode.ASYNC: AsyncStrategy,
}

__all__ = ["STRATEGIES", "Context", "StepResult", "Strategy"]
