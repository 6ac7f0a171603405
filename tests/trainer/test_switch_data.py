"""The data a rebalanced sync step reads after async: four real trainer processes (gloo over loopback).

In async each rank reads its own shard at its own pace, so the ranks stand at different offsets when
the controller switches back to sync with per-rank batch sizes. Rebalanced sync reads one global
batch a step (data.ShardedStream.next_batch_of), which needs one position on every rank: entering
sync agrees on it (data.rebase), so each step reads the next contiguous run of the epoch's
permutation, as plain sync and DDP would, and no sample is skipped.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.trainer_modes import free_port_base, spawned_rank_env
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.trainer import Trainer
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import RunConfig

pytestmark = pytest.mark.multiproc
WORLD = 4
STEPS = 30
SPLIT = {0: 20, 1: 20, 2: 20, 3: 4}


def _child(rank: int, port: int, out: str) -> None:
    spawned_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    emulation = {"computeSeconds": 0.01, "slowdowns": [{"rank": 3, "factor": 3.0}]}
    training = {"steps": STEPS, "batchSize": 16, "learningRate": 0.05, "seed": 5, "emulation": emulation}
    config = RunConfig.model_validate(
        {"mode": "async", "referenceWorldSize": WORLD, "training": training | {"async": {"shards": 2}}}
    )
    trainer = Trainer(config)
    stream = trainer.stream
    stream.trace = []
    marks: list[dict[str, Any]] = []
    trainer.switch_observers.append(
        lambda t: marks.append({"mode": t.state.mode.value, "read": len(stream.trace or []), "step": t.state.step})
    )
    if trainer.inbox is not None:
        inbox, telemetry = trainer.inbox, trainer.telemetry

        def push() -> None:  # rank 0's controller: back to sync, with a split, after 12 async steps
            while telemetry.status().step < 12 and not telemetry.done:
                time.sleep(0.002)
            inbox.offer(ControlCommand(epoch=1, mode=SyncMode.SYNC, batch_sizes=SPLIT, reason="rebalanced sync"))

        threading.Thread(target=push, daemon=True).start()
    trainer.train()
    trainer.server.stop()
    order = stream._dataset_indices(stream._perm_for(0)).tolist()  # type: ignore[attr-defined]
    doc = {"trace": stream.trace, "marks": marks, "order": order, "step": trainer.state.step}
    Path(out, f"{rank}.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("switch-data")
    mp.spawn(_child, args=(free_port_base(1), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


def test_rebalanced_sync_after_async_reads_one_global_batch_a_step(ranks: list[dict[str, Any]]) -> None:
    position = {index: p for p, index in enumerate(ranks[0]["order"])}
    for r in ranks:
        assert [m["mode"] for m in r["marks"]] == ["sync"] and r["step"] == STEPS
    switched = ranks[0]["marks"][0]["step"]
    async_reads = [r["trace"][: r["marks"][0]["read"]] for r in ranks]
    sync_reads = [r["trace"][r["marks"][0]["read"] :] for r in ranks]
    offsets = [len(a) for a in async_reads]
    assert len(set(offsets)) > 1, f"the ranks left async at different offsets: {offsets}"
    steps = STEPS - switched
    for rank, reads in enumerate(sync_reads):
        assert len(reads) == SPLIT[rank] * steps, (rank, len(reads), steps)
    windows = []
    for k in range(steps):
        batch = sorted(
            position[i] for rank, reads in enumerate(sync_reads) for i in reads[SPLIT[rank] * k : SPLIT[rank] * (k + 1)]
        )
        # One global batch: the next 64 positions of the permutation, whoever reads which.
        assert batch == list(range(batch[0], batch[0] + 64)), f"step {switched + k + 1} reads {batch}"
        windows.append(batch[0])
    assert windows == list(range(windows[0], windows[0] + 64 * steps, 64)), "consecutive steps, consecutive batches"
    read = {position[i] for reads in (*async_reads, *sync_reads) for i in reads}
    assert read == set(range(max(read) + 1)), "no sample of the epoch skipped"
    again = sum(len(r) for r in (*async_reads, *sync_reads)) - len(read)
    print(f"async offsets {offsets}, switched at step {switched}, {again} samples read twice (between the offsets)")
