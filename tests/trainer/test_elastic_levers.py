"""World-size changes through checkpoints, and the efficiency levers against their references.

Three spawns of real processes (gloo over loopback) share one checkpoint directory: 4 ranks train
to step 40, 3 ranks resume and train to step 80, 4 ranks resume and train to step 120. Each
resume applies the linear learning-rate rule for its world and re-shards the data so that no sample
of the epoch is read twice. The first spawn then compares gradient accumulation, fp16 with loss
scaling (alone and with accumulation), bf16 autocast and bf16-compressed allreduce with plain fp32
sync SGD on the same data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.trainer_modes import free_port_base, spawned_rank_env
from sgdjob_trainer.levers import lr_factor
from sgdjob_trainer.trainer import Trainer
from sgdjob_trainer.wire.launch_contract import RunConfig

pytestmark = pytest.mark.multiproc
REFERENCE = 4
LR = 0.05
PHASES = ((4, 40), (3, 80), (4, 120))  # (world size, steps to reach)


def _config(steps: int, ckpt: str | None = None, **training: Any) -> RunConfig:
    base: dict[str, Any] = {"steps": steps, "batchSize": 16, "learningRate": LR, "seed": 11, "lrScaling": "linear"}
    if ckpt is not None:
        base["checkpoint"] = {"dir": ckpt, "intervalSteps": 10}
    return RunConfig.model_validate({"mode": "sync", "referenceWorldSize": REFERENCE, "training": base | training})


def _flat(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.state.model.parameters()])


def _run(config: RunConfig) -> Trainer:
    trainer = Trainer(config)
    trainer.train()
    trainer.server.stop()  # the process group stays up for the next run
    return trainer


def _levers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = {
        "ref": {},
        "accum": {"batchSize": 8, "gradientAccumulationSteps": 2},
        "fp16": {"precision": "fp16"},
        "fp16_accum": {"precision": "fp16", "batchSize": 8, "gradientAccumulationSteps": 2},
        "bf16": {"precision": "bf16"},
        "compressed": {"compression": "bf16"},
        "schedule": {"lrPolicy": {"warmupSteps": 5, "schedule": "cosine", "minFactor": 0.2}},
    }
    for name, levers in runs.items():
        trainer = _run(_config(30, **levers))
        out[name] = {
            "flat": _flat(trainer).tolist(),
            "final": trainer.telemetry.final_loss,
            "initial": trainer.telemetry.initial_loss,
            "samples": trainer.telemetry.samples,
            "scale": trainer.state.scaler.scale,
            "skipped": trainer.state.scaler.skipped,
            "lr": trainer.state.optimizer.param_groups[0]["lr"],
            "ctx_lr": trainer.ctx.lr_scale * trainer.training.learning_rate,
        }
    return out


def _child(rank: int, world: int, port: int, out: str, ckpt: str, steps: int, levers: bool) -> None:
    spawned_rank_env(rank, world, port)
    torch.set_num_threads(1)
    trainer = Trainer(_config(steps, ckpt))
    resumed = trainer.state.step
    trainer.stream.trace = []
    lr_before = trainer.state.optimizer.param_groups[0]["lr"]
    trainer.train()
    trainer.server.stop()
    result: dict[str, Any] = {
        "resumed": resumed,
        "step": trainer.state.step,
        "lr": trainer.training.learning_rate * trainer.lr_scale,
        "lr_in_optimizer": trainer.state.optimizer.param_groups[0]["lr"],
        "lr_loaded": lr_before,
        "trace": trainer.stream.trace,
        "initial": trainer.telemetry.initial_loss,
        "final": trainer.telemetry.final_loss,
        "stalls": trainer.recovery.ckpt.stalls if trainer.recovery.ckpt else [],
    }
    if levers:
        result["levers"] = _levers()
    Path(out, f"{world}-{steps}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("elastic")
    ckpt = str(out / "ckpt")
    results = []
    for i, (world, steps) in enumerate(PHASES):
        mp.spawn(_child, args=(world, free_port_base(1), str(out), ckpt, steps, i == 0), nprocs=world, join=True)
        results.append([json.loads((out / f"{world}-{steps}-{r}.json").read_text()) for r in range(world)])
    return results


def test_world_4_3_4_resumes_with_the_lr_rule_and_each_sample_once(phases: list[list[dict[str, Any]]]) -> None:
    previous_final = None
    trace: list[int] = []
    for (world, steps), ranks in zip(PHASES, phases, strict=True):
        start = 0 if previous_final is None else PHASES[PHASES.index((world, steps)) - 1][1]
        for r in ranks:
            assert r["resumed"] == start and r["step"] == steps
            assert r["lr"] == pytest.approx(LR * world / REFERENCE), "linear rule relative to the reference world"
            assert r["lr_in_optimizer"] == pytest.approx(r["lr"]), "the checkpoint's learning rate does not stick"
            trace += r["trace"]
        if previous_final is not None:
            # Loss continues where it was: the resumed model evaluates as the saved one did.
            assert ranks[0]["initial"] == pytest.approx(previous_final, rel=1e-5)
        previous_final = ranks[0]["final"]
        print(
            f"world {world}: steps {start}->{steps}, "
            f"loss {ranks[0]['initial']:.4f} -> {ranks[0]['final']:.4f}, stalls ms",
            [round(s * 1e3, 2) for s in ranks[0]["stalls"]],
        )
    expected = 16 * sum(world * (steps - (PHASES[i - 1][1] if i else 0)) for i, (world, steps) in enumerate(PHASES))
    assert len(trace) == expected and len(set(trace)) == expected, "every sample of the epoch read once"
    assert phases[-1][0]["final"] < phases[0][0]["initial"] / 5


def test_levers_match_their_references(phases: list[list[dict[str, Any]]]) -> None:
    levers = [r["levers"] for r in phases[0]]
    ref = torch.tensor(levers[0]["ref"]["flat"])
    moved = float((ref - torch.tensor(levers[0]["schedule"]["flat"])).abs().max())
    assert moved > 1e-3, "the runs differ where they should"
    for lv in levers:
        assert lv["ref"]["final"] < lv["ref"]["initial"] / 3
        # Accumulating 2 x 8 samples is the same gradient as one batch of 16 (the same samples).
        assert float((torch.tensor(lv["accum"]["flat"]) - ref).abs().max()) < 1e-5
        assert lv["accum"]["samples"] == lv["ref"]["samples"] == 30 * 16
        for name in ("fp16", "fp16_accum", "bf16", "compressed"):
            # Half-precision rounding in every forward pass: close, not equal, after 30 steps.
            assert lv[name]["final"] == pytest.approx(lv["ref"]["final"], rel=0.12), name
            assert float((torch.tensor(lv[name]["flat"]) - ref).abs().max()) < 0.05, name
        for name in ("fp16", "fp16_accum"):
            # The scale starts at 2^16, which overflows fp16 activations' gradients here: each such
            # step is skipped (on every rank alike) and the scale halves, as GradScaler does.
            skipped = lv[name]["skipped"]
            assert (
                lv[name]["scale"] == 2.0 ** (16 - skipped)
                and 0 <= skipped <= 3
                and lv[name]["samples"] == (30 - skipped) * 16
            )
        assert lv["ref"]["scale"] == 1.0
        sched = lv["schedule"]
        assert sched["lr"] == pytest.approx(
            sched["ctx_lr"]
            * lr_factor(
                _config(30, lrPolicy={"warmupSteps": 5, "schedule": "cosine", "minFactor": 0.2}).training.lr_policy,
                29,
                30,
            )
        )
