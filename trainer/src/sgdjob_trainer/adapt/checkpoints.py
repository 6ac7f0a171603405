"""Checkpoints of a script on the adaptation API: the script's own file, written by its `save`
function, in the trainer's checkpoint layout (checkpoint.py), so the same rules make them safe and
`sgdjob run` reads their steps as it reads the trainer's:

    step-0000000120/
        checkpoint.pt    what save(path) wrote (rank 0: under DDP every rank holds the same state)
        meta.json        step, world size, the file's size and sha256, and the session's own state:
                         the control epoch, the split of the batch, the data position
        COMPLETE         the sha256 of meta.json, written last

The session's state rides in meta.json, so a resumed script continues with the split in force and
from the sample where the world stood, whatever the script's `save` holds.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.checkpoint import TMP_PREFIX, CheckpointError, commit, complete_checkpoints, retain, verify

log = logging.getLogger("sgdjob_trainer.adapt")
FILE = "checkpoint.pt"
KIND = "adaptation-api"  # meta.json's `kind`: the trainer's own checkpoints have none


def file_digest(path: Path) -> dict[str, Any]:
    """checkpoint.file_entry of a file, read in chunks (a script's checkpoint may be large)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def write(
    root: Path,
    step: int,
    life: str,
    save: Callable[[str], None],
    session: dict[str, Any],
    world_size: int,
    keep: int,
) -> Path:
    """Rank 0: the complete checkpoint of `step` (the script's file and the session's state); the
    newest `keep` are retained."""
    tmp = root / f"{TMP_PREFIX}{step:010d}-{life}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save(str(tmp / FILE))
    if not (tmp / FILE).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"save({str(tmp / FILE)!r}) wrote no file at the path it was given")
    meta = {"kind": KIND, "world_size": world_size, "life": life, "files": {FILE: file_digest(tmp / FILE)}}
    target = commit(root, tmp, step, {**meta, "session": session})
    retain(root, keep)
    return target


def newest(root: Path, rejected: set[str]) -> tuple[str, dict[str, Any]] | None:
    """Rank 0: the newest checkpoint that verifies and is a script's (its directory name and
    meta.json), skipping `rejected` and adding to it what does not verify."""
    for path in complete_checkpoints(root):
        if path.name in rejected:
            continue
        try:
            meta = verify(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", path, err)
            rejected.add(path.name)
            continue
        if meta.get("kind") != KIND:
            log.warning("skipping checkpoint %s: not written through the adaptation API", path)
            rejected.add(path.name)
            continue
        return path.name, meta
    return None


def load_newest(root: Path, load: Callable[[str], None], comm: Comm, rank: int) -> dict[str, Any] | None:
    """Collective: `load` the newest good checkpoint on every rank; its meta.json, or None when there
    is none. A checkpoint that fails to load on any rank is skipped for an older one on every rank."""
    rejected: set[str] = set()
    while True:
        choice = comm.broadcast(newest(root, rejected) if rank == 0 else None)
        if choice is None:
            return None
        name, meta = choice
        ok = 1
        try:
            load(str(root / name / FILE))
        except Exception as err:  # the script's own code: any failure skips this checkpoint
            log.warning("rank %d cannot load checkpoint %s: %s: %s", rank, name, type(err).__name__, err)
            ok = 0
        if comm.all_min(ok):
            return dict(meta)
        log.warning("checkpoint %s could not be loaded on every rank; trying an older one", name)
        rejected.add(name)
