"""Checkpoints: asynchronous, atomic, multi-writer, verified on load.

Layout of `training.checkpoint.dir` (a shared volume in a cluster):
    step-0000000120/          one complete checkpoint, named by the job step it holds
        model-00000.pt        model + optimizer of a model owner, with its weight (ranks it stands for)
        rank-00000.pt         per rank: RNG streams, loss-scaler state, hosted parameter-server shards
        rank-00000.json       per rank sidecar: its files' sizes and sha256, its data position
        ...
        meta.json             rank 0: step, mode, control epoch, batch sizes, groups, world size,
                              every file's size and sha256, every rank's data position
        COMPLETE              written last: the sha256 of meta.json
    .tmp-step-0000000130-<life>/   a checkpoint being written (life: random id of this start)
    progress.json             rank 0's newest step and time, and the job's restart history
    job.json                  the job the directory belongs to: another job refuses to start in it

Who writes what (the model owners depend on the mode, because the model lives in different places):
- sync: every rank holds the same model; rank 0 writes it (weight = world size) with the optimizer.
- hierarchical: each group's lowest rank writes its group's model (weight = group size); a resume
  averages the group models (and their optimizer states) by weight, as a switch out of hierarchical does.
- async: rank 0's model is the parameter server's (it pulls the fresh model every step) and rank 0
  writes it; each shard host adds its shards (parameters, momentum, version) to its rank file.
  Rank 0 asks for the checkpoint through shard 0's reply, so every worker writes its part at its
  next exchange (its own step may differ; the checkpoint is named by rank 0's step).
- every rank writes its own rank file and sidecar; rank 0's writer thread finalises.

Writing: at a checkpoint step a rank copies what it must save to CPU memory (the only stall of
training, measured as `stallSeconds`) and hands it to a background thread, which serialises it,
writes each file as `name.part`, fsyncs it and renames it, and then the sidecar the same way. Rank 0
waits (up to completeTimeoutSeconds) until all ranks' sidecars exist, writes meta.json, fsyncs
the directory, renames `.tmp-...` to `step-...`, and only then writes COMPLETE. Retention keeps
the newest `keep` complete checkpoints and removes older and abandoned directories.

Loading: rank 0 walks the complete checkpoints newest first, checks COMPLETE against meta.json and
every file's size and sha256, and offers the first good one; every rank loads its files
(torch.load weights_only) and the ranks agree (allreduce) that all succeeded, else rank 0 skips to
an older one. A corrupt or partial checkpoint is skipped with a warning, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sgdjob_trainer.config import Checkpoint

log = logging.getLogger("sgdjob_trainer.checkpoint")
FORMAT = 1
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
FAILED_SUFFIX = ".failed"  # a rank's marker in a step's temp directory: its part will never come
COMPLETE = "COMPLETE"
META = "meta.json"
PROGRESS = "progress.json"
OWNER = "job.json"
# Rank 0 notes its step this often at most: a restart counts lost steps from the newest note.
PROGRESS_EVERY_S = 0.05


class CheckpointError(Exception):
    """A checkpoint that must not be loaded (missing marker or file, wrong size or checksum)."""


class CheckpointDirInUse(CheckpointError):
    """The checkpoint directory holds another job's checkpoints."""


class CheckpointDirNotShared(CheckpointError):
    """Some ranks do not see the others' checkpoint directory (each pod's own disk)."""


def claim_dir(root: Path, job: str, rank: int) -> None:
    """Make `root` this job's checkpoint directory, or refuse: resuming another job's checkpoints
    would silently continue that job's model and data position under this job's name. The same
    name is the same job (a job deleted and applied again resumes). Rank 0 writes the claim."""
    owner_file = root / OWNER
    try:
        owner = json.loads(owner_file.read_text()).get("job")
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointDirInUse(
            f"training.checkpoint.dir {root}: unreadable {OWNER} ({err}); remove it if this directory is this job's"
        ) from err
    if owner is not None and owner != job:
        raise CheckpointDirInUse(
            f"training.checkpoint.dir {root} holds the checkpoints of job {owner!r}, not of {job!r}: "
            f"give each job its own spec.training.checkpoint.dir (or remove {root} if job {owner!r} is done with it)"
        )
    if owner is None and rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            write_atomic(owner_file, json.dumps({"job": job}).encode())
        except OSError as err:  # a full volume: claimed at a later start; its checkpoints fail meanwhile
            log.warning("cannot claim training.checkpoint.dir %s for job %s: %s", root, job, err)


def check_shared(root: Path, life: str, rank: int, world_size: int, group: Any = None) -> None:
    """Every rank must see one and the same directory: rank 0 finalises a checkpoint only once every
    rank's part is there, so on per-pod disks it would wait `completeTimeoutSeconds` at every
    checkpoint and training would stall behind it. Rank 0 writes a marker named by this life; the
    ranks that cannot see it are named in the error (collective: every rank raises)."""
    marker = root / f".visible-{life}"
    # The last slot: rank 0 could not write the marker (a full or read-only volume). Then nothing can
    # be checked, and the checkpoints' own failures will be reported; training starts anyway.
    missing = torch.zeros(world_size + 1, dtype=torch.int64)
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, life.encode())
        except OSError as err:
            log.warning("cannot check that training.checkpoint.dir %s is shared: %s", root, err)
            missing[world_size] = 1
    dist.barrier(group=group)
    if not missing[world_size]:
        try:
            missing[rank] = int(marker.read_text() != life)
        except OSError:
            missing[rank] = 1
    dist.all_reduce(missing, group=group)
    dist.barrier(group=group)
    if rank == 0:
        marker.unlink(missing_ok=True)
    if missing[world_size]:
        return
    blind = [r for r in range(world_size) if missing[r]]
    if blind:
        raise CheckpointDirNotShared(
            f"training.checkpoint.dir {root} is not one directory shared by every worker: rank(s) "
            f"{blind} do not see rank 0's files there (each pod writes to its own disk). Mount one volume "
            "that every worker shares (a ReadWriteMany PersistentVolumeClaim, NFS) at this path in "
            "spec.template, or leave out training.checkpoint to train without checkpoints"
        )


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:010d}"


def cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor copied to CPU memory: what the writer thread may own."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write to `path.part`, fsync, rename: a reader sees the whole file or none."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def file_entry(data: bytes) -> dict[str, Any]:
    """A file's line in meta.json's `files`: what `verify` checks it against."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(root: Path, tmp: Path, step: int, meta: dict[str, Any]) -> Path:
    """Make the written temp directory `tmp` the complete checkpoint of `step`: meta.json into it,
    then the rename, then COMPLETE, each made durable before the next, so a crash at any point leaves
    either no checkpoint of `step` or one that verifies. `meta` must list every file under `files`."""
    meta_bytes = json.dumps({**meta, "format": FORMAT, "step": step}, indent=1).encode()
    write_atomic(tmp / META, meta_bytes)
    fsync_dir(tmp)
    target = step_dir(root, step)
    if target.exists():  # left by an earlier life that got this far but was never loaded
        shutil.rmtree(target)
    os.rename(tmp, target)
    fsync_dir(root)
    write_atomic(target / COMPLETE, hashlib.sha256(meta_bytes).hexdigest().encode())
    fsync_dir(target)
    return target


@dataclass(slots=True)
class Snapshot:
    """One rank's share of checkpoint `step`, already copied to CPU memory."""

    step: int
    world_size: int
    part: dict[str, Any]
    data: dict[str, int]
    model: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None  # rank 0 only: the job-wide fields of meta.json


@dataclass(slots=True)
class Checkpointer:
    """One per process; `take` is called by the training loop, the rest runs on a writer thread."""

    cfg: Checkpoint
    rank: int
    life: str
    root: Path = field(init=False)
    last: int = 0  # newest checkpoint step this rank has taken (or resumed from)
    stalls: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (step, error) of writes that failed
    _queue: queue.Queue[Snapshot] = field(default_factory=lambda: queue.Queue(maxsize=1))
    _progress_at: float = 0.0
    _progress_failed: bool = False

    def __post_init__(self) -> None:
        assert self.cfg.dir is not None
        self.root = Path(self.cfg.dir)
        with contextlib.suppress(OSError):  # a full volume: every write fails, is counted, and training goes on
            self.root.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._run, name="sgdjob-checkpoint", daemon=True).start()

    def due(self, step: int) -> bool:
        return step - self.last >= self.cfg.interval_steps

    def take(self, snapshot_fn: Any, step: int) -> float:
        """Copy this rank's state (`snapshot_fn()` -> Snapshot, tensors still live) and queue it.
        Blocks only while an earlier checkpoint of this rank is still queued. Returns the stall."""
        start = time.perf_counter()
        snap: Snapshot = cpu_copy_snapshot(snapshot_fn())
        self._queue.put(snap)
        self.last = step
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        return stall

    def flush(self) -> None:
        """Wait until every queued checkpoint of this rank is written (rank 0: and finalised)."""
        self._queue.join()

    # -- writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            snap = self._queue.get()
            start = time.perf_counter()
            try:
                self._write(snap)
                self.writes.append(time.perf_counter() - start)
            except Exception as err:
                log.exception("checkpoint of step %d failed on rank %d; training goes on", snap.step, self.rank)
                error = f"{type(err).__name__}: {err}"[:300]
                self.failures.append((snap.step, error))
                try:
                    self._give_up(snap.step, error)
                except OSError:  # rank 0 removing the directory under us: the writer thread must live on
                    log.warning("clean-up of checkpoint step %d on rank %d incomplete", snap.step, self.rank)
            finally:
                self._queue.task_done()

    def _give_up(self, step: int, error: str) -> None:
        """The step can no longer complete, and on a full volume its partial files hold the space the next
        checkpoint needs: rank 0 removes the step's directory; another rank removes its own files (the
        directory is shared: removing it would fail rank 0's write in progress) and leaves a marker, so
        rank 0 gives up at once instead of waiting completeTimeoutSeconds for a part that never comes."""
        tmp = self.root / f"{TMP_PREFIX}{step:010d}-{self.life}"
        if self.rank == 0:
            # Older steps of this life too: a slower rank may have made its directory again after
            # rank 0 removed it, to leave its marker there.
            for path in self.root.glob(f"{TMP_PREFIX}*-{self.life}"):
                if path.name[len(TMP_PREFIX) :].split("-")[0] <= f"{step:010d}":
                    shutil.rmtree(path, ignore_errors=True)
            return
        for path in tmp.glob(f"*-{self.rank:05d}.*"):
            path.unlink(missing_ok=True)
        marker = tmp / f"rank-{self.rank:05d}{FAILED_SUFFIX}"
        try:
            marker.write_text(error)
        except OSError:
            with contextlib.suppress(OSError):
                marker.touch()  # no room for the text: an empty marker needs no data block

    def _write(self, snap: Snapshot) -> None:
        tmp = self.root / f"{TMP_PREFIX}{snap.step:010d}-{self.life}"
        tmp.mkdir(parents=True, exist_ok=True)
        files: dict[str, Any] = {}
        blobs = {f"rank-{self.rank:05d}.pt": snap.part}
        if snap.model is not None:
            blobs[f"model-{self.rank:05d}.pt"] = snap.model
        for name, obj in blobs.items():
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = buf.getvalue()
            write_atomic(tmp / name, data)
            files[name] = file_entry(data)
        sidecar = {"rank": self.rank, "step": snap.step, "files": files, "data": snap.data}
        write_atomic(tmp / f"rank-{self.rank:05d}.json", json.dumps(sidecar).encode())
        if snap.meta is not None:
            self._finalize(tmp, snap)

    def _finalize(self, tmp: Path, snap: Snapshot) -> None:
        deadline = time.monotonic() + self.cfg.complete_timeout_seconds
        names = [f"rank-{r:05d}.json" for r in range(snap.world_size)]
        while not all((tmp / n).exists() for n in names):
            if failed := sorted(tmp.glob(f"rank-*{FAILED_SUFFIX}")):
                why = "; ".join(f"{m.name.removesuffix(FAILED_SUFFIX)}: {_read(m) or 'see its log'}" for m in failed)
                raise CheckpointError(f"another rank's part of step {snap.step} failed ({why})")
            if time.monotonic() > deadline:
                missing = [n for n in names if not (tmp / n).exists()]
                log.warning(
                    "checkpoint of step %d abandoned: no part from %s within %.0f s",
                    snap.step,
                    missing,
                    self.cfg.complete_timeout_seconds,
                )
                shutil.rmtree(tmp, ignore_errors=True)
                return
            time.sleep(0.02)
        sidecars = [json.loads((tmp / n).read_text()) for n in names]
        files: dict[str, Any] = {}
        for doc in sidecars:
            files.update(doc["files"])
        meta = dict(snap.meta or {})
        meta.update(
            world_size=snap.world_size,
            life=self.life,
            files=files,
            positions=[d["data"] for d in sidecars],
        )
        commit(self.root, tmp, snap.step, meta)
        self.completed.append(snap.step)
        log.info("checkpoint of step %d complete (%d files)", snap.step, len(files))
        self.retain()

    def retain(self) -> None:
        retain(self.root, self.cfg.keep)

    def remove_stale(self) -> None:
        remove_stale(self.root, self.life)

    # -- progress (rank 0) ----------------------------------------------------------------------
    def note_progress(
        self,
        step: int,
        history: list[dict[str, Any]],
        *,
        force: bool = False,
        lineage: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """Rank 0's high-water mark, a few times a second: what a restart counts as lost steps, and
        (`lineage`, Telemetry.lineage) the job's start and validations, which a restart continues."""
        now = time.time()
        if force or now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            doc = {"life": self.life, "step": step, "time": now, "resumes": history, **(lineage() if lineage else {})}
            try:
                write_atomic(self.root / PROGRESS, json.dumps(doc).encode(), sync=False)
            except OSError as err:
                # Only the lost-step figure of a later restart rests on it: a full volume costs that
                # figure's precision, never the training.
                if not self._progress_failed:
                    log.warning("cannot record progress in %s (%s); training goes on", self.root, err)
                self._progress_failed = True


def retain(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; remove older ones and the incomplete
    directories older than the newest complete one (they can never complete)."""
    complete = complete_checkpoints(root)
    newest = _step_of(complete[0]) if complete else -1
    for path in complete[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f"{STEP_PREFIX}*"):
        if not (path / COMPLETE).exists() and _step_of(path) < newest:
            shutil.rmtree(path, ignore_errors=True)


def remove_stale(root: Path, life: str) -> None:
    """At start: temp directories of earlier lives can never complete."""
    for path in root.glob(f"{TMP_PREFIX}*"):
        if not path.name.endswith(f"-{life}"):
            shutil.rmtree(path, ignore_errors=True)


def cpu_copy_snapshot(snap: Snapshot) -> Snapshot:
    snap.part = cpu_copy(snap.part)
    snap.model = cpu_copy(snap.model) if snap.model is not None else None
    return snap


def _read(path: Path) -> str:
    try:
        return path.read_text()[:200]
    except OSError:
        return ""


def _step_of(path: Path) -> int:
    try:
        return int(path.name[len(STEP_PREFIX) :])
    except ValueError:
        return -1


def complete_checkpoints(root: Path) -> list[Path]:
    """Directories with a COMPLETE marker, newest step first (not yet verified)."""
    found = [p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and _step_of(p) >= 0 and (p / COMPLETE).exists()]
    return sorted(found, key=_step_of, reverse=True)


def verify(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint whose marker, files, sizes and checksums all check out."""
    try:
        meta_bytes = (path / META).read_bytes()
        marker = (path / COMPLETE).read_text().strip()
        if marker != hashlib.sha256(meta_bytes).hexdigest():
            raise CheckpointError("COMPLETE does not match meta.json")
        meta: dict[str, Any] = json.loads(meta_bytes)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"format {meta.get('format')} is not {FORMAT}")
        for name, entry in meta["files"].items():
            data = (path / name).read_bytes()
            if file_entry(data) != entry:
                raise CheckpointError(f"{name}: size or sha256 differs from meta.json")
        return meta
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(str(err)) from err


def load_file(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def read_progress(root: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((root / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
