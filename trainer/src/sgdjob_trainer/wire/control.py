"""Commands a controller sends to a running job (POST /control), as plain data.

Torch-free: the operator and the local runner build these; the trainer parses them and applies
them in epoch order.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from sgdjob_trainer.config import CamelModel, SyncMode


class ControlCommand(CamelModel):
    """Switch mode and/or regroup/rebalance. `epoch` orders commands: older epochs are ignored."""

    epoch: Annotated[
        int, Field(ge=0, description="Monotonic command number; a command with an epoch already applied is ignored.")
    ]
    mode: Annotated[SyncMode | None, Field(description="Mode to switch to; omit to keep the current mode.")] = None
    groups: Annotated[
        list[list[int]] | None, Field(description="Hierarchical groups of global ranks (every rank in one group).")
    ] = None
    batch_sizes: Annotated[
        dict[int, int] | None,
        Field(description="Per-rank batch sizes for rebalanced sync; ranks not listed keep theirs."),
    ] = None
    reason: Annotated[str, Field(max_length=4096, description="Why the controller sent it, for logs and reports.")] = ""


def merge(old: ControlCommand | None, new: ControlCommand) -> ControlCommand:
    """The one merge rule: the command equal to applying `old` and then `new`, as the trainer
    applies them (mode and groups: the newer one given wins; batch sizes: per rank, newer wins).

    The trainer's inbox merges commands that arrive before a step boundary with it, and controllers
    store the merge of everything they sent, so a restarted trainer gets exactly the state the
    running ones have."""
    if old is None:
        return new
    batch_sizes = {**(old.batch_sizes or {}), **(new.batch_sizes or {})} or None
    return ControlCommand(
        epoch=max(old.epoch, new.epoch),
        mode=new.mode if new.mode is not None else old.mode,
        groups=new.groups if new.groups is not None else old.groups,
        batch_sizes=batch_sizes,
        reason=new.reason or old.reason,
    )
