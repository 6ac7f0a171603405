"""Plain PyTorch DDP under torchrun: what a Kubeflow PyTorchJob user runs today. The baseline.

It trains the same model on the same data shard with the same emulated per-rank compute as
SGDJob's trainer (`--config` takes the same RunConfig file), but with nothing of ours in the loop:
DistributedDataParallel's bucketed allreduce every step, one fixed batch size, no switching.
Each rank writes `rank-<rank>.json` to SGDJOB_REPORT_DIR with the fields the benchmark reads.

  torchrun --standalone --nproc-per-node=4 -m bench.ddp_baseline --config run.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sgdjob_trainer.__main__ import load_run_config
from sgdjob_trainer.assembly import assemble
from sgdjob_trainer.data import DataPosition
from sgdjob_trainer.emulation import ComputeEmulator
from sgdjob_trainer.optim import set_lr
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.validation import Validator

# Every step, like the trainer's loss history, so time-to-target is read at the same resolution.
LOSS_EVERY = 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, required=True)
    cfg = load_run_config(parser.parse_args().config)
    info = WorldInfo.from_env()
    dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size)
    train = cfg.training
    # The trainer's own assembly: the same task (built-in model and dataset, or `training.task`), the
    # same held-out split, optimizer and learning-rate schedule; only the loop below is plain DDP.
    parts = assemble(train, info, torch.device("cpu"), DataPosition(), None)
    net, optimizer, stream, eval_x, eval_y = parts.model, parts.optimizer, parts.stream, parts.eval_x, parts.eval_y
    model = DistributedDataParallel(net)
    loss_fn = parts.task.loss
    lr_scale = train.lr_scaling.factor(info.world_size, cfg.reference_world_size)
    emulator = ComputeEmulator(train.emulation, info.rank, info.node, train.batch_size, train.seed)

    # Rank 0 validates on the held-out split between steps, as the trainer's rank 0 does
    # (training.evaluation: the same samples, the same schedule, the same accuracy and metric); the
    # other ranks wait for it at the next allreduce.
    validator = (
        Validator(train.evaluation, eval_x, eval_y, loss_fn, parts.task.is_classification(), parts.task.metric)
        if info.rank == 0
        else None
    )
    validations: list[dict[str, float | int | None]] = []

    def full_loss() -> float:
        with torch.no_grad():
            return float(loss_fn(net(eval_x), eval_y))

    initial = full_loss()
    dist.barrier()
    start = time.perf_counter()
    curve: list[list[float]] = [[0.0, 0, initial]]
    compute = 0.0
    if validator is not None:  # the curve's first point is the initial model at 0 s, as in the trainer's
        first = validator.run(net)
        validations.append(
            {
                "step": 0,
                "time_s": 0.0,
                "samples": 0,
                "loss": first.loss,
                "accuracy": first.accuracy,
                "metric": first.metric,
            }
        )
    for step in range(train.steps):
        x, y = stream.next_batch(train.batch_size)
        emulated = emulator.run(step, train.batch_size)
        set_lr(optimizer, lr_scale * parts.schedule(step))
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # DDP's allreduce happens inside backward and waits for the slowest rank
        optimizer.step()
        compute += emulated
        if (step + 1) % LOSS_EVERY == 0 or step + 1 == train.steps:
            curve.append([time.perf_counter() - start, step + 1, float(loss.detach())])
        if validator is not None and (validator.due(step + 1) or step + 1 == train.steps):
            result = validator.run(net)
            validations.append(
                {
                    "step": step + 1,
                    "time_s": time.perf_counter() - start,
                    "samples": (step + 1) * train.batch_size * info.world_size,
                    "loss": result.loss,
                    "accuracy": result.accuracy,
                    "metric": result.metric,
                }
            )
    wall = time.perf_counter() - start
    final = full_loss()
    out = os.environ.get("SGDJOB_REPORT_DIR")
    if out:
        record = {
            "rank": info.rank,
            "steps": train.steps,
            "samples": train.steps * train.batch_size,
            "wallSeconds": wall,
            "computeSeconds": compute,
            "initialLoss": initial,
            "finalLoss": final,
            "lossCurve": curve,
            "validationCurve": validations,
        }
        path = Path(out) / f"rank-{info.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    # Every rank has its record before anyone tears down; the DDP wrapper (its reducer holds the
    # process group) goes before the group does.
    dist.barrier()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run is complete and recorded. Interpreter teardown can still abort the process ("terminate
    # called without an active exception" from a C++ thread joined at static destruction, seen here
    # about once in ten runs), which torchrun reports as a failed baseline: skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
