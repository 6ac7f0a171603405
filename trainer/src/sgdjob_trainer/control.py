"""Commands a controller sends to a running job (POST /control), as plain data.

Torch-free: the operator and the local runner build these; the trainer parses them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from sgdjob_trainer.config import CamelModel, SyncMode


class ControlCommand(CamelModel):
    """Switch mode and/or regroup/rebalance. `epoch` orders commands: older epochs are ignored."""

    epoch: Annotated[int, Field(ge=0, description="Monotonic command number; a command with an epoch already applied is ignored.")]
    mode: Annotated[SyncMode | None, Field(description="Mode to switch to; omit to keep the current mode.")] = None
    groups: Annotated[list[list[int]] | None, Field(description="Hierarchical groups of global ranks (every rank in one group).")] = None
    batch_sizes: Annotated[dict[int, int] | None, Field(description="Per-rank batch sizes for rebalanced sync; ranks not listed keep theirs.")] = None
    reason: Annotated[str, Field(max_length=4096, description="Why the controller sent it, for logs and reports.")] = ""
