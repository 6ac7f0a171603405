"""Checkpoint files, verification, retention, data re-sharding and the levers, in one process."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sgdjob_trainer.checkpoint import (
    COMPLETE,
    CheckpointDirInUse,
    Checkpointer,
    CheckpointError,
    Snapshot,
    claim_dir,
    complete_checkpoints,
    step_dir,
    verify,
)
from sgdjob_trainer.config import Checkpoint, LrPolicy, LrSchedule, TrainingConfig
from sgdjob_trainer.data import DataPosition, ShardedStream, rebase, synthetic_dataset
from sgdjob_trainer.levers import LossScaler, lr_factor
from sgdjob_trainer.resume import average_models, average_optimizers, read_checkpoint


def _snapshot(step: int, world: int, rank: int, value: float) -> Snapshot:
    model = {
        "model": {"w": torch.full((3,), value), "n": torch.tensor(7)},
        "optimizer": {"state": {}, "param_groups": []},
        "weight": world,
    }
    part = {
        "jitter_rng": random.Random(rank).getstate(),
        "torch_rng": torch.get_rng_state(),
        "scaler": {},
        "ps_shards": {},
    }
    meta = {"mode": "sync", "control_epoch": 2, "batch_sizes": {}, "groups": None} if rank == 0 else None
    return Snapshot(
        step=step,
        world_size=world,
        part=part,
        data={"epoch": 0, "base": 0, "offset": 16 * step},
        model=model if rank == 0 else None,
        meta=meta,
    )


def _write(root: Path, steps: list[int], world: int = 2, keep: int = 3) -> Checkpointer:
    cfg = Checkpoint(dir=str(root), interval_steps=10, keep=keep, complete_timeout_seconds=30)
    writers = [Checkpointer(cfg, rank, "life1") for rank in range(world)]
    for step in steps:
        for rank in reversed(range(world)):  # rank 0 last: its finaliser must wait for the others anyway
            writers[rank].take(lambda s=step, r=rank: _snapshot(s, world, r, float(s)), step)
        for w in writers:
            w.flush()
    return writers[0]


def test_complete_checkpoint_layout_and_retention(tmp_path: Path) -> None:
    writer = _write(tmp_path, [10, 20, 30, 40], keep=2)
    assert writer.completed == [10, 20, 30, 40]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-0000000040", "step-0000000030"], "keep=2"
    path = step_dir(tmp_path, 40)
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "meta.json",
        "model-00000.pt",
        "rank-00000.json",
        "rank-00000.pt",
        "rank-00001.json",
        "rank-00001.pt",
    ]
    meta = verify(path)
    assert meta["step"] == 40 and meta["world_size"] == 2 and meta["positions"][1]["offset"] == 640
    assert not list(tmp_path.glob(".tmp-*")), "temp directories are renamed"
    loaded = read_checkpoint(path, rank=1, world_size=2)
    assert torch.equal(loaded.model["w"], torch.full((3,), 40.0)) and loaded.part is not None
    assert loaded.position == DataPosition(0, 640, 0) or loaded.position == DataPosition(epoch=0, offset=640, base=0)
    smaller = read_checkpoint(path, rank=0, world_size=1)
    assert smaller.part is None and smaller.position == DataPosition(epoch=0, base=2 * 640, offset=0), (
        "a new world rebases"
    )
    assert writer.stalls and max(writer.stalls) < 1.0


@pytest.mark.parametrize("damage", ["truncate", "flip", "marker", "meta", "missing"])
def test_damaged_checkpoints_are_refused(tmp_path: Path, damage: str) -> None:
    _write(tmp_path, [10, 20])
    path = step_dir(tmp_path, 20)
    target = path / "model-00000.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "marker":
        (path / COMPLETE).write_text("0" * 64)
    elif damage == "meta":
        (path / "meta.json").write_text((path / "meta.json").read_text()[:-5])
    else:
        (path / "rank-00001.pt").unlink()
    with pytest.raises(CheckpointError):
        verify(path)
    with pytest.raises(CheckpointError):
        read_checkpoint(path, 0, 2)
    verify(step_dir(tmp_path, 10))  # the older one is still good


def test_partial_checkpoint_is_never_complete(tmp_path: Path) -> None:
    cfg = Checkpoint(dir=str(tmp_path), interval_steps=10, complete_timeout_seconds=1)
    rank0 = Checkpointer(cfg, 0, "lifeA")
    start = time.monotonic()
    rank0.take(lambda: _snapshot(10, 2, 0, 1.0), 10)  # rank 1 never writes its part
    rank0.flush()
    assert time.monotonic() - start >= 1.0 and complete_checkpoints(tmp_path) == []
    assert not list(tmp_path.glob(".tmp-*")), "an abandoned checkpoint is removed"
    (tmp_path / ".tmp-step-0000000020-old").mkdir()
    Checkpointer(cfg, 0, "lifeB").remove_stale()
    assert not (tmp_path / ".tmp-step-0000000020-old").exists()


def test_a_ranks_failed_part_ends_the_step_at_once_and_leaves_no_data(tmp_path: Path) -> None:
    """Rank 1's part cannot be written (here: it cannot be pickled; on a full volume: no space). Rank 0
    gives the step up as soon as rank 1's marker appears, not after completeTimeoutSeconds, and both
    writers go on to write the next step whole."""
    cfg = Checkpoint(dir=str(tmp_path), interval_steps=10, complete_timeout_seconds=60)
    rank0, rank1 = Checkpointer(cfg, 0, "lifeC"), Checkpointer(cfg, 1, "lifeC")
    bad = _snapshot(10, 2, 1, 1.0)
    bad.part["unpicklable"] = lambda: None
    start = time.monotonic()
    rank1.take(lambda: bad, 10)
    rank1.flush()
    rank0.take(lambda: _snapshot(10, 2, 0, 1.0), 10)
    rank0.flush()
    assert time.monotonic() - start < 10, "rank 0 waited out the timeout instead of reading the marker"
    assert [s for s, _ in rank1.failures] == [10] and [s for s, _ in rank0.failures] == [10]
    assert "rank-00001" in rank0.failures[0][1], rank0.failures
    assert complete_checkpoints(tmp_path) == [] and not list(tmp_path.glob(".tmp-*"))
    for rank, writer in ((1, rank1), (0, rank0)):
        writer.take(lambda r=rank: _snapshot(20, 2, r, 2.0), 20)
        writer.flush()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-0000000020"]


def test_average_models_weights_groups() -> None:
    parts = [
        {"model": {"w": torch.tensor([0.0, 3.0]), "n": torch.tensor(1)}, "weight": 3},
        {"model": {"w": torch.tensor([4.0, 7.0]), "n": torch.tensor(2)}, "weight": 1},
    ]
    avg = average_models(parts)
    assert torch.allclose(avg["w"], torch.tensor([1.0, 4.0])) and int(avg["n"]) == 1


def test_group_owners_adam_states_merge_as_a_switch_would() -> None:
    """A hierarchical checkpoint holds one optimizer per group: a resume takes their mean by group
    size (moments) and the largest step count, not a reset."""

    def adam_after(steps: int, grad: float) -> dict[str, Any]:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.Adam([p], lr=0.1)
        for _ in range(steps):
            p.grad = torch.full((2,), grad)
            opt.step()
        return opt.state_dict()

    parts = [{"optimizer": adam_after(3, 1.0), "weight": 3}, {"optimizer": adam_after(5, 2.0), "weight": 1}]
    merged = average_optimizers(parts)
    state = merged["state"][0]
    expected = 0.75 * parts[0]["optimizer"]["state"][0]["exp_avg"] + 0.25 * parts[1]["optimizer"]["state"][0]["exp_avg"]
    assert torch.allclose(state["exp_avg"], expected) and float(state["step"]) == 5.0
    p = torch.nn.Parameter(torch.zeros(2))
    fresh = torch.optim.Adam([p], lr=0.1)
    fresh.load_state_dict(merged)  # a real optimizer takes it
    assert float(fresh.state[p]["step"]) == 5.0


def test_rebase_sees_every_sample_once_across_world_sizes() -> None:
    ds = synthetic_dataset()
    seen: list[int] = []
    positions = [DataPosition() for _ in range(4)]
    for world, steps in ((4, 20), (3, 30), (4, 10)):
        start = rebase(positions)
        positions = [DataPosition(start.epoch, start.offset, start.base) for _ in range(world)]
        streams = [ShardedStream(ds, r, world, seed=3, position=positions[r]) for r in range(world)]
        for s in streams:
            s.trace = seen
            for _ in range(steps):
                s.next_batch(16)
    assert len(seen) == 16 * (4 * 20 + 3 * 30 + 4 * 10) and len(set(seen)) == len(seen)
    # Unequal offsets (async): never skip a sample, repeat at most the gap.
    uneven = rebase([DataPosition(0, 32), DataPosition(0, 48)])
    assert uneven == DataPosition(epoch=0, offset=0, base=64)
    assert rebase([DataPosition(1, 0, 0), DataPosition(0, 100, 8)]).base == 8 + 2 * 100


def test_lr_warmup_and_schedules() -> None:
    warm = LrPolicy(warmup_steps=4)
    assert [lr_factor(warm, s, 100) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = LrPolicy(schedule=LrSchedule.COSINE, min_factor=0.1)
    assert (
        lr_factor(cosine, 0, 100) == 1.0
        and lr_factor(cosine, 50, 100) == pytest.approx(0.55)
        and lr_factor(cosine, 100, 100) == pytest.approx(0.1)
    )
    step = LrPolicy(schedule=LrSchedule.STEP, step_size=10, gamma=0.5, warmup_steps=2)
    assert lr_factor(step, 11, 100) == 1.0 and lr_factor(step, 12, 100) == 0.5 and lr_factor(step, 32, 100) == 0.125


def test_loss_scaler_skips_overflow_and_grows() -> None:
    scaler = LossScaler(True)
    grad = torch.full((4,), scaler.scale * 0.5)
    assert scaler.unscale(grad) and torch.allclose(grad, torch.full((4,), 0.5))
    before = scaler.scale
    assert not scaler.unscale(torch.tensor([math.inf, 1.0])) and scaler.scale == before / 2 and scaler.skipped == 1
    scaler.clean_steps = 1999
    assert scaler.unscale(torch.ones(2)) and scaler.scale == before
    restored = LossScaler(True)
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert restored.state_dict() == scaler.state_dict()
    off = LossScaler(False)
    assert off.scale == 1.0 and off.unscale(torch.tensor([math.nan]))


def test_config_levers_and_faults_validate() -> None:
    levers = {
        "precision": "fp16",
        "gradientAccumulationSteps": 4,
        "compression": "bf16",
        "lrPolicy": {"warmupSteps": 10, "schedule": "cosine"},
    }
    t = TrainingConfig.model_validate(levers | {"faults": [{"rank": 2, "atStep": 30}]})
    assert t.faults[0].restart == 0 and t.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="exactly one of atStep"):
        TrainingConfig.model_validate({"faults": [{"rank": 1}]})
    with pytest.raises(ValueError, match="rank 5 does not exist"):
        TrainingConfig.model_validate({"faults": [{"rank": 5, "afterSeconds": 1}]}).check_world(4)
    once, loop = TrainingConfig.model_validate(
        {"faults": [{"rank": 1, "atStep": 5, "restart": 1}, {"rank": 1, "atStep": 5, "everyLife": True}]}
    ).faults
    assert [once.fires_in(1, n) for n in range(3)] == [False, True, False]
    assert [loop.fires_in(1, n) for n in range(3)] == [True, True, True] and not loop.fires_in(0, 0)
    with pytest.raises(ValueError, match="everyLife"):
        TrainingConfig.model_validate({"faults": [{"atStep": 5, "restart": 2, "everyLife": True}]})


def test_a_checkpoint_dir_belongs_to_one_job(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    claim_dir(root, "resnet-a", rank=1)
    assert not (root / "job.json").exists(), "only rank 0 writes the claim"
    claim_dir(root, "resnet-a", rank=0)
    claim_dir(root, "resnet-a", rank=3)  # the same job again (a restart, or deleted and applied again)
    with pytest.raises(
        CheckpointDirInUse,
        match=(
            r"training.checkpoint.dir .* holds the checkpoints of job 'resnet-a', "
            r"not of 'resnet-b': give each job its own"
        ),
    ):
        claim_dir(root, "resnet-b", rank=0)
    assert json.loads((root / "job.json").read_text()) == {"job": "resnet-a"}


def _shared_child(rank: int, port: int, roots: list[str], out: str) -> None:
    import torch.distributed as dist

    from bench.trainer_modes import spawned_rank_env
    from sgdjob_trainer.checkpoint import CheckpointDirNotShared, check_shared

    spawned_rank_env(rank, 3, port)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        check_shared(Path(roots[rank]), "life-1", rank, 3)
        result = ""
    except CheckpointDirNotShared as err:
        result = str(err)
    (Path(out) / f"{rank}.txt").write_text(result)
    dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("shared", [True, False])
def test_a_checkpoint_dir_that_the_ranks_do_not_share_is_refused_naming_the_field(tmp_path: Path, shared: bool) -> None:
    """Per-pod disks (each rank its own folder) would stall every checkpoint for completeTimeoutSeconds:
    every rank fails at start instead, naming the ranks that cannot see rank 0's files and the fix."""
    import torch.multiprocessing as mp

    from bench.trainer_modes import free_port_base

    roots = [str(tmp_path / "shared")] * 3 if shared else [str(tmp_path / "shared")] * 2 + [str(tmp_path / "own")]
    mp.spawn(_shared_child, args=(free_port_base(1), roots, str(tmp_path)), nprocs=3, join=True)
    results = [(tmp_path / f"{r}.txt").read_text() for r in range(3)]
    if shared:
        assert results == ["", "", ""]
        assert not list((tmp_path / "shared").glob(".visible-*")), "the marker is removed"
    else:
        for text in results:
            assert text.startswith("training.checkpoint.dir ") and "rank(s) [2]" in text, text
            assert "ReadWriteMany" in text
