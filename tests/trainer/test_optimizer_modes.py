"""A stateful optimizer (AdamW) in every mode, on four real trainer processes (gloo over loopback).

One spawn runs: an AdamW job switched sync -> async -> hierarchical -> sync mid-run, with the model
and the optimizer state checked equal on every rank after each switch and Adam's step count and
moments carried over (never reset); then a checkpoint/resume round trip that must reproduce the
uninterrupted run's parameters.
"""

from __future__ import annotations

import itertools
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
from sgdjob_trainer.optim import flat_state
from sgdjob_trainer.trainer import Trainer
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import RunConfig

pytestmark = pytest.mark.multiproc
WORLD = 4
CHAIN = ("async", "hierarchical", "sync")
SWITCH_EVERY = 12
ADAMW = {"name": "adamw", "betas": [0.9, 0.99], "weightDecay": 0.01}


def _config(steps: int, **training: Any) -> RunConfig:
    base: dict[str, Any] = {
        "steps": steps,
        "batchSize": 16,
        "learningRate": 0.01,
        "seed": 3,
        "optimizer": ADAMW,
        "evaluation": {"everySteps": None},
    }
    return RunConfig.model_validate({"mode": "sync", "referenceWorldSize": WORLD, "training": base | training})


def _flat(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.state.model.parameters()])


def _spread(mine: torch.Tensor) -> float:
    """Largest difference between this rank's tensor and any other rank's (collective)."""
    every = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    return max(float((other - mine).abs().max()) for other in every)


def _adamw_chain(rank: int) -> dict[str, Any]:
    checks: list[dict[str, Any]] = []

    def observe(trainer: Trainer) -> None:
        params = [p for p in trainer.state.model.parameters() if p.requires_grad]
        state = flat_state(trainer.state.optimizer, params)
        checks.append(
            {
                "mode": trainer.state.mode.value,
                "step": trainer.state.step,
                "param_spread": _spread(_flat(trainer)),
                "state_spread": max(_spread(state[k].float()) for k in ("exp_avg", "exp_avg_sq")),
                "adam_steps": float(state["step"]),
                "second_moment": float(state["exp_avg_sq"].abs().sum()),
                "loss": trainer.evaluate(),
            }
        )

    def drive(trainer: Trainer) -> None:
        trainer.switch_observers.append(observe)
        if trainer.inbox is None:
            return
        inbox, telemetry = trainer.inbox, trainer.telemetry

        def push() -> None:
            for epoch, mode in enumerate(CHAIN, start=1):
                while telemetry.status().step < SWITCH_EVERY * epoch and not telemetry.done:
                    time.sleep(0.005)
                inbox.offer(ControlCommand(epoch=epoch, mode=SyncMode(mode), groups=[[0, 1], [2, 3]], reason="chain"))
                while telemetry.mode.value != mode and not telemetry.done:
                    time.sleep(0.005)

        threading.Thread(target=push, daemon=True).start()

    emulation = {"computeSeconds": 0.004, "jitter": 0.2, "slowdowns": [{"rank": 3, "factor": 2.0}]}
    trainer = Trainer(
        _config(
            60,
            emulation=emulation,
            hierarchical={"averageEvery": 2, "staleness": 1},
            **{"async": {"staleness": None, "shards": 2}},
        )
    )
    drive(trainer)
    before = trainer.evaluate()
    trainer.train()
    trainer.server.stop()
    return {
        "checks": checks,
        "loss": [before, trainer.telemetry.final_loss],
        "optimizer": type(trainer.state.optimizer).__name__,
        "final_spread": _spread(_flat(trainer)),
    }


def _resume(rank: int, ckpt: str) -> dict[str, Any]:
    straight = Trainer(_config(30))
    straight.train()
    straight.server.stop()
    first = Trainer(_config(15, checkpoint={"dir": ckpt, "intervalSteps": 5}))
    first.train()
    first.server.stop()
    second = Trainer(_config(30, checkpoint={"dir": ckpt, "intervalSteps": 5}))
    resumed_at = second.state.step
    second.train()
    second.server.stop()
    return {"resumed_at": resumed_at, "diff": float((_flat(second) - _flat(straight)).abs().max())}


def _child(rank: int, port: int, out: str) -> None:
    spawned_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    results = {"chain": _adamw_chain(rank), "resume": _resume(rank, str(Path(out) / "ckpt"))}
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("optim")
    mp.spawn(_child, args=(free_port_base(1), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


def test_adamw_switches_modes_without_losing_its_state(results: list[dict[str, Any]]) -> None:
    for r in results:
        chain = r["chain"]
        checks = chain["checks"]
        if r is results[0]:
            print("switch checks on rank 0:", checks)
        assert chain["optimizer"] == "AdamW"
        assert [c["mode"] for c in checks] == list(CHAIN)
        for c in checks:
            assert c["param_spread"] < 1e-6 and c["state_spread"] < 1e-6, "one model and one optimizer state"
            assert c["second_moment"] > 0, "Adam's moments carried over, not reset"
        steps = [c["adam_steps"] for c in checks]
        # Adam's step count only grows: at least the sync steps before the first switch, and more
        # after async (each shard counts every worker's push).
        assert steps[0] >= SWITCH_EVERY and steps == sorted(steps) and steps[1] > steps[0]
        # A continuous loss curve: no switch undoes the progress made before it.
        losses = [chain["loss"][0]] + [c["loss"] for c in checks] + [chain["loss"][1]]
        assert all(b < a * 1.1 for a, b in itertools.pairwise(losses)), losses
        assert chain["loss"][1] < chain["loss"][0] / 3
        assert chain["final_spread"] < 1e-6


def test_adamw_checkpoint_resume_reproduces_the_uninterrupted_run(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["resume"]["resumed_at"] == 15
        assert r["resume"]["diff"] < 1e-6, "moments and step count restored exactly"
