"""Resume at start: every rank loads the newest complete checkpoint that every rank can read.

Collective (all ranks call `load_latest` at the same point). Rank 0 picks the newest checkpoint
that verifies (checkpoint.verify), broadcasts its name, every rank reads its files (checking each
file's sha256 again, so a file damaged since is caught too) without touching its state, and an
allreduce(MIN) tells whether all could; only then is anything applied. Otherwise rank 0 tries the
next older one. The checkpoint's mode is restored whatever mode the run config names: the job
continues as it was. World-size changes: the model (average of the owners' models by weight) and
the job-wide fields load as they are; data positions are rebased (data.rebase) and per-rank state
(RNG streams, parameter-server shards) is only taken from a checkpoint of the same world size.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sgdjob_trainer.checkpoint import CheckpointError, complete_checkpoints, verify
from sgdjob_trainer.data import DataPosition, rebase
from sgdjob_trainer.train_state import TrainState

log = logging.getLogger("sgdjob_trainer.resume")


@dataclass(slots=True)
class Loaded:
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    part: dict[str, Any] | None
    position: DataPosition


def _read(path: Path, name: str, meta: dict[str, Any]) -> Any:
    data = (path / name).read_bytes()
    if meta["files"][name] != {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}:
        raise CheckpointError(f"{name} changed since the checkpoint was verified")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def average_models(parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Weighted mean of the owners' model states (floating tensors); other tensors from the first."""
    total = float(sum(p["weight"] for p in parts))
    out: dict[str, torch.Tensor] = {}
    for key, first in parts[0]["model"].items():
        if first.is_floating_point():
            out[key] = sum(
                (p["model"][key].double() * (p["weight"] / total) for p in parts),
                torch.zeros_like(first, dtype=torch.float64),
            ).to(first.dtype)
        else:
            out[key] = first
    return out


def average_optimizers(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The owners' optimizer states merged as a switch out of hierarchical merges them
    (optim.average_state): tensors shaped like their parameter by weight, step counts the largest;
    the groups' settings from the first owner."""
    total = float(sum(p["weight"] for p in parts))
    first = parts[0]["optimizer"]
    merged: dict[Any, dict[str, Any]] = {}
    for index in first["state"]:
        entries = [p["optimizer"]["state"].get(index, {}) for p in parts]
        merged[index] = {}
        for key, value in entries[0].items():
            if not isinstance(value, torch.Tensor) or any(key not in e for e in entries):
                merged[index][key] = value
            elif value.dim() == 0:
                merged[index][key] = max((e[key] for e in entries), key=float).clone()
            else:
                weighted = (e[key].double() * (p["weight"] / total) for e, p in zip(entries, parts, strict=True))
                merged[index][key] = sum(weighted, torch.zeros_like(value, dtype=torch.float64)).to(value.dtype)
    return {"state": merged, "param_groups": first["param_groups"]}


def read_checkpoint(path: Path, rank: int, world_size: int) -> Loaded:
    """Everything this rank needs from one checkpoint; raises on any problem, changes nothing."""
    meta = verify(path)
    owners = sorted(n for n in meta["files"] if n.startswith("model-"))
    if not owners:
        raise CheckpointError("no model file")
    parts = [_read(path, name, meta) for name in owners]
    model = average_models(parts)
    optimizer = parts[0]["optimizer"] if len(parts) == 1 else average_optimizers(parts)
    same_world = int(meta["world_size"]) == world_size
    part = _read(path, f"rank-{rank:05d}.pt", meta) if same_world else None
    positions = [
        DataPosition(epoch=int(p["epoch"]), base=int(p["base"]), offset=int(p["offset"])) for p in meta["positions"]
    ]
    position = positions[rank] if same_world else rebase(positions)
    return Loaded(meta, model, optimizer, part, position)


def load_latest(
    root: Path, state: TrainState, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> dict[str, Any] | None:
    """Collective. Load the newest good checkpoint into `state`; its meta.json, or None."""
    rejected: set[str] = set()
    while True:
        choice: list[Any] = [None]
        if rank == 0:
            for path in complete_checkpoints(root):
                if path.name in rejected:
                    continue
                try:
                    verify(path)
                except CheckpointError as err:
                    log.warning("skipping checkpoint %s: %s", path, err)
                    rejected.add(path.name)
                    continue
                choice[0] = path.name
                break
        dist.broadcast_object_list(choice, src=0, group=group)
        if choice[0] is None:
            return None
        loaded: Loaded | None = None
        try:
            loaded = read_checkpoint(root / choice[0], rank, world_size)
        except Exception as err:  # any unreadable piece: this checkpoint is out, for every rank
            log.warning("rank %d cannot load checkpoint %s: %s", rank, choice[0], err)
        ok = torch.tensor([1 if loaded is not None else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if int(ok) and loaded is not None:
            _apply(loaded, state, world_size)
            return loaded.meta
        log.warning("checkpoint %s could not be loaded on every rank; trying an older one", choice[0])
        rejected.add(choice[0])


def _apply(loaded: Loaded, state: TrainState, world_size: int) -> None:
    state.model.load_state_dict(loaded.model)
    if loaded.optimizer is not None:
        state.optimizer.load_state_dict(loaded.optimizer)
    else:
        state.optimizer.state.clear()
    state.load_meta(loaded.meta, world_size)
    if loaded.part is not None:
        state.load_rank_part(loaded.part)
    # Mutate in place: the data stream holds this same object.
    state.data.epoch, state.data.base, state.data.offset = (
        loaded.position.epoch,
        loaded.position.base,
        loaded.position.offset,
    )
