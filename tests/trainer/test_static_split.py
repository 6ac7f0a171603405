"""A static split of sync's step from step 0 (`training.rankBatchSizes`, the LB-BSP baseline a user
sets by hand): three real trainer processes (gloo over loopback) read their own batch sizes from the
first step on, and each step reads one global batch, as plain sync over the same global batch would.
The claim a rebalance rests on: the split run ends with plain sync's model (same seed, same global
batch), so a rebalance changes who computes, never what is learned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.trainer_modes import free_port_base, spawned_rank_env
from sgdjob_trainer.trainer import Trainer
from sgdjob_trainer.wire.launch_contract import RunConfig

pytestmark = pytest.mark.multiproc
WORLD = 3
STEPS = 6
SPLIT = [26, 26, 8]
PLAIN = 20  # the same global batch of 60, split equally


def _child(rank: int, port: int, out: str, split: bool) -> None:
    spawned_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    training: dict[str, Any] = {"steps": STEPS, "batchSize": PLAIN, "learningRate": 0.05, "seed": 3}
    if split:
        training["rankBatchSizes"] = SPLIT
    trainer = Trainer(RunConfig.model_validate({"mode": "sync", "referenceWorldSize": WORLD, "training": training}))
    stream = trainer.stream
    stream.trace = []
    initial = torch.cat([p.detach().reshape(-1) for p in trainer.state.model.parameters()]).tolist()
    trainer.train()
    trainer.server.stop()
    order = stream._dataset_indices(stream._perm_for(0)).tolist()  # type: ignore[attr-defined]
    status = trainer.telemetry.status()
    params = torch.cat([p.detach().reshape(-1) for p in trainer.state.model.parameters()]).tolist()
    doc = {"trace": stream.trace, "order": order, "samples": status.samples, "batch": status.batch_size}
    doc |= {"params": params, "initial": initial}
    Path(out, f"{rank}.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("static-split")
    mp.spawn(_child, args=(free_port_base(1), str(out), True), nprocs=WORLD, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("plain-sync")
    mp.spawn(_child, args=(free_port_base(1), str(out), False), nprocs=WORLD, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


def test_each_rank_reads_its_own_batch_from_the_first_step_and_steps_read_one_global_batch(
    ranks: list[dict[str, Any]],
) -> None:
    position = {index: p for p, index in enumerate(ranks[0]["order"])}
    for rank, doc in enumerate(ranks):
        assert len(doc["trace"]) == SPLIT[rank] * STEPS and doc["samples"] == SPLIT[rank] * STEPS, rank
        assert doc["batch"] == SPLIT[rank]  # what /metrics and /status tell the controllers
    total = sum(SPLIT)
    for k in range(STEPS):
        batch = sorted(
            position[i] for r, doc in enumerate(ranks) for i in doc["trace"][SPLIT[r] * k : SPLIT[r] * (k + 1)]
        )
        assert batch == list(range(total * k, total * (k + 1))), f"step {k + 1} reads {batch}"


def test_the_split_run_ends_with_plain_syncs_model(ranks: list[dict[str, Any]], plain: list[dict[str, Any]]) -> None:
    split_model, plain_model = torch.tensor(ranks[0]["params"]), torch.tensor(plain[0]["params"])
    moved = (plain_model - torch.tensor(plain[0]["initial"])).abs().max().item()
    assert moved > 1e-3, "the comparison is not between two trained models"
    assert all(torch.equal(torch.tensor(d["params"]), split_model) for d in ranks), "sync keeps one model"
    # Only the order of a float sum differs (each rank's mean gradient weighted by its batch).
    diff = (split_model - plain_model).abs().max().item()
    print(
        f"rankBatchSizes {SPLIT} vs plain sync {PLAIN}x{WORLD} after {STEPS} steps:",
        f"max diff {diff:.2e}, moved {moved:.2e}",
    )
    assert diff < 1e-5 * max(1.0, moved), diff
