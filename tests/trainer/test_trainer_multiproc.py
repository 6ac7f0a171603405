"""Four real trainer processes (torch.multiprocessing, gloo over loopback), several runs each.

One spawn serves several Trainer runs in a row so the processes pay the torch import once:
sync against torch's DistributedDataParallel, rebalanced sync against plain sync per sample, a
run through all six ordered mode switches with the model checked equal on every rank after each
switch, a split that lands at the step it was sent in, an async start with three parameter-server
shards and a hierarchical start.
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from bench.trainer_modes import free_port_base, spawned_rank_env
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.data import ShardedStream, build_dataset, held_out_indices
from sgdjob_trainer.networks import build_model
from sgdjob_trainer.trainer import Trainer
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import RunConfig

pytestmark = pytest.mark.multiproc
WORLD = 4
CHAIN = ("hierarchical", "async", "sync", "async", "hierarchical", "sync")


def _config(mode: str, steps: int, **training: Any) -> RunConfig:
    base: dict[str, Any] = {"steps": steps, "batchSize": 16, "learningRate": 0.05, "seed": 5}
    return RunConfig.model_validate({"mode": mode, "referenceWorldSize": WORLD, "training": base | training})


def _run(config: RunConfig, before: Any = None) -> Trainer:
    trainer = Trainer(config)
    if before is not None:
        before(trainer)
    trainer.train()
    trainer.server.stop()  # the process group stays up for the next run
    return trainer


def _flat(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.state.model.parameters()])


def _spread(trainer: Trainer) -> float:
    """Largest difference between this rank's parameters and any other rank's (collective)."""
    mine = _flat(trainer)
    every = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    return max(float((other - mine).abs().max()) for other in every)


def _sync_vs_ddp(rank: int) -> dict[str, Any]:
    steps = 25
    mine = _run(_config("sync", steps, momentum=0.9))
    model = build_model("mlp", seed=5)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=mine.training.learning_rate * mine.lr_scale, momentum=0.9)
    dataset = build_dataset("synthetic")
    # The trainer trains on everything but its held-out validation split; so does the reference.
    held_out = held_out_indices(len(dataset), mine.training.evaluation.samples)  # type: ignore[arg-type]
    stream = ShardedStream(dataset, rank, WORLD, seed=5, held_out=held_out)
    for _ in range(steps):
        x, y = stream.next_batch(16)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    reference = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    start = torch.cat([p.detach().reshape(-1) for p in build_model("mlp", seed=5).parameters()])
    return {
        "ddp_max_diff": float((_flat(mine) - reference).abs().max()),
        "moved": float((reference - start).abs().max()),
    }


def _quarter_batch_on_rank3(trainer: Trainer) -> None:
    # What a ControlCommand(batchSizes={3: 8}) applies at a switch point, here from the start.
    trainer.state.batch_sizes.update({3: 8})
    trainer.telemetry.set_batch_size(trainer.ctx.batch_size())


def _rebalanced(rank: int) -> dict[str, Any]:
    plain = _run(_config("sync", 40, batchSize=32))
    # Rank 3 takes a quarter batch: 104 samples per step, so 49 steps see about the same samples.
    rebalanced = _run(_config("sync", 49, batchSize=32), _quarter_batch_on_rank3)
    return {
        "plain": [plain.telemetry.initial_loss, plain.telemetry.final_loss, plain.telemetry.samples],
        "rebalanced": [rebalanced.telemetry.final_loss, rebalanced.telemetry.samples, rebalanced.telemetry.batch_size],
        "spread": _spread(rebalanced),
    }


def _switch_chain(rank: int) -> dict[str, Any]:
    checks: list[dict[str, Any]] = []

    def observe(trainer: Trainer) -> None:
        checks.append({"mode": trainer.state.mode.value, "step": trainer.state.step, "spread": _spread(trainer)})

    def drive(trainer: Trainer) -> None:
        trainer.switch_observers.append(observe)
        if trainer.inbox is None:
            return
        inbox, telemetry = trainer.inbox, trainer.telemetry

        def push() -> None:  # rank 0's controller: next mode once this rank runs the previous one
            for epoch, mode in enumerate(CHAIN, start=1):
                while telemetry.status().step < 8 * epoch and not telemetry.done:
                    time.sleep(0.005)
                inbox.offer(
                    ControlCommand(epoch=epoch, mode=SyncMode(mode), groups=[[0, 1], [2, 3]], reason=f"chain {epoch}")
                )
                while telemetry.mode.value != mode and not telemetry.done:
                    time.sleep(0.005)

        threading.Thread(target=push, daemon=True).start()

    emulation = {"computeSeconds": 0.004, "jitter": 0.2, "slowdowns": [{"rank": 3, "factor": 2.0}]}
    trainer = _run(
        _config(
            "sync",
            400,
            emulation=emulation,
            hierarchical={"averageEvery": 2, "staleness": 1},
            **{"async": {"staleness": None, "shards": 2}},
        ),
        drive,
    )
    status = trainer.telemetry.status().document()  # across processes as JSON, as served
    return {
        "checks": checks,
        "switches": status["switches"],
        "loss": [trainer.telemetry.initial_loss, trainer.telemetry.final_loss],
        "final_spread": _spread(trainer),
        "step": status["step"],
        "epoch": status["controlEpoch"],
    }


def _count_tails(run: Any) -> tuple[Any, int]:
    """Run `run()` counting this rank's separate tail allreduces (3 elements: samples, epoch, stop)
    next to the gradient's."""
    count = [0]
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() == 3 and tensor.dtype == torch.float64:
            count[0] += 1
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        return run(), count[0]
    finally:
        dist.all_reduce = original


def _landing(rank: int) -> dict[str, Any]:
    """Rank 0's controller sends a new split while rank 0 waits in a step's exchange for a straggler
    (rank 3, ten times slower): the split rides the next step, every rank at once, and every step
    is one allreduce (no separate tail), with a straggler as on an equal fleet."""
    applied: list[int] = []
    sent: list[int] = []

    def drive(trainer: Trainer) -> None:
        trainer.switch_observers.append(lambda t: applied.append(t.state.step))
        if trainer.inbox is None:
            return
        inbox, telemetry = trainer.inbox, trainer.telemetry

        def push() -> None:
            while telemetry.status().step < 3:
                time.sleep(0.001)
            while not telemetry.computing:  # the fourth step's compute starts ...
                time.sleep(0.001)
            while telemetry.computing:  # ... and ends: rank 0 now waits for rank 3 (~0.45 s)
                time.sleep(0.001)
            time.sleep(0.02)
            sent.append(telemetry.status().step)
            inbox.offer(ControlCommand(epoch=1, batch_sizes={3: 1}, reason="landing"))

        threading.Thread(target=push, daemon=True).start()

    emulation = {"computeSeconds": 0.05, "slowdowns": [{"rank": 3, "factor": 10.0}]}
    trainer, tails = _count_tails(lambda: _run(_config("sync", 8, emulation=emulation), drive))
    _, equal_tails = _count_tails(lambda: _run(_config("sync", 8, emulation={"computeSeconds": 0.05})))
    return {"applied": applied, "sent": sent, "batch": trainer.ctx.batch_size(3), "tails": [tails, equal_tails]}


def _async_start(rank: int) -> dict[str, Any]:
    trainer = _run(_config("async", 50, learningRate=0.1, **{"async": {"staleness": 4, "shards": 3}}))
    t = trainer.telemetry
    return {"loss": [t.initial_loss, t.final_loss], "step": t.step, "samples": t.samples, "spread": _spread(trainer)}


def _hierarchical_start(rank: int) -> dict[str, Any]:
    emulation = {"computeSeconds": 0.004, "slowdowns": [{"rank": 3, "factor": 3.0}]}
    trainer = _run(
        _config(
            "hierarchical",
            48,
            emulation=emulation,
            hierarchical={"groups": [[0, 1, 2], [3]], "averageEvery": 2, "staleness": 2},
        )
    )
    t = trainer.telemetry
    return {
        "loss": [t.initial_loss, t.final_loss],
        "step": t.step,
        "groups": trainer.state.groups,
        "spread": _spread(trainer),
    }


def _child(rank: int, port: int, out: str) -> None:
    spawned_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"seconds": {}}
    phases = (
        ("ddp", _sync_vs_ddp),
        ("rebalanced", _rebalanced),
        ("chain", _switch_chain),
        ("landing", _landing),
        ("async", _async_start),
        ("hierarchical", _hierarchical_start),
    )
    for name, fn in phases:
        start = time.monotonic()
        results[name] = fn(rank)
        results["seconds"][name] = round(time.monotonic() - start, 2)
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mp")
    mp.spawn(_child, args=(free_port_base(1), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


def test_sync_matches_ddp(results: list[dict[str, Any]]) -> None:
    print("phase seconds on rank 0:", results[0]["seconds"])
    for r in results:
        assert r["ddp"]["ddp_max_diff"] < 1e-5
        assert r["ddp"]["moved"] > 1e-3, "the comparison is not between two untrained models"


def test_rebalanced_sync_converges_like_sync_per_sample(results: list[dict[str, Any]]) -> None:
    r0 = results[0]["rebalanced"]
    (initial, plain_final, _), (final, _, _) = r0["plain"], r0["rebalanced"]
    plain_samples = sum(r["rebalanced"]["plain"][2] for r in results)
    samples = sum(r["rebalanced"]["rebalanced"][1] for r in results)
    assert abs(samples - plain_samples) / plain_samples < 0.02
    assert final < initial / 5 and plain_final < initial / 5
    assert 0.6 < final / plain_final < 1.6
    assert results[3]["rebalanced"]["rebalanced"][2] == 8 and results[3]["rebalanced"]["rebalanced"][1] == 49 * 8
    assert all(r["rebalanced"]["spread"] == 0.0 for r in results), "sync keeps every rank's model equal"


def test_every_switch_pair_keeps_one_model(results: list[dict[str, Any]]) -> None:
    chain = [r["chain"] for r in results]
    for c in chain:
        assert [s["toMode"] for s in c["switches"]] == list(CHAIN)
        assert [c["mode"] for c in c["checks"]] == list(CHAIN)
        assert all(check["spread"] < 1e-6 for check in c["checks"]), c["checks"]
        assert c["epoch"] == len(CHAIN) and c["step"] == 400 and c["final_spread"] < 1e-6
        assert c["loss"][1] < c["loss"][0] / 5
    pairs = {(s["fromMode"], s["toMode"]) for s in chain[0]["switches"]}
    assert len(pairs) == 6
    for i in range(len(CHAIN)):
        assert len({c["switches"][i]["step"] for c in chain}) == 1, "all ranks switch at the same step"
        assert all(c["switches"][i]["pauseS"] >= 0 for c in chain)


def test_a_split_sent_during_the_wait_for_a_straggler_rides_the_next_step_in_one_allreduce(
    results: list[dict[str, Any]],
) -> None:
    print("separate tail allreduces (straggler run, equal fleet):", [r["landing"]["tails"] for r in results])
    assert results[0]["landing"]["sent"] == [3], "sent while rank 0 waited in the fourth step's exchange"
    for r in results:
        assert r["landing"]["applied"] == [5], "applied after the fifth step, every rank"
        assert r["landing"]["batch"] == 1
        # One collective a step whatever the wait: a second one cost sync 25-35 % of its throughput
        # under a real CPU quota (base.Strategy.weighted_allreduce).
        assert r["landing"]["tails"] == [0, 0], r["landing"]["tails"]


def test_async_start_with_three_shards_learns_and_ends_consistent(results: list[dict[str, Any]]) -> None:
    for r in results:
        a = r["async"]
        assert a["loss"][1] < a["loss"][0] * 0.7 and a["step"] == 50 and a["spread"] < 1e-6
    assert max(r["async"]["samples"] for r in results) > 0


def test_hierarchical_start_learns_and_averages_at_the_end(results: list[dict[str, Any]]) -> None:
    for r in results:
        h = r["hierarchical"]
        assert h["loss"][1] < h["loss"][0] / 3 and h["step"] == 48 and h["spread"] < 1e-6
        assert h["groups"] == [[0, 1, 2], [3]]
