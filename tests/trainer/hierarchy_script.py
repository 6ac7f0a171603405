"""Run by tests/trainer/test_adapt_hierarchy.py and test_adapt_async.py under torchrun (4 gloo ranks): a
script on the adaptation API whose ranks claim two nodes of two ranks each (NODE_NAME, as the downward
API sets it), and an opt-in slow rank (an EMULATED straggler: it sleeps longer before its backward
pass). Each rank writes one JSON line a step to OUT/rank<R>.jsonl: the step, the mode the session is
in, the wall clock, the epoch and the batch's sample indices, its parameters and its momentum buffers.
It trains until `--after-sync` steps after it came back to sync from `--left` (every rank sees the
switch at the same step), or `--max-steps` (in async the rank that reaches it first ends every rank's
training). OUT/pid<R> holds the rank's process id, for a test that kills it."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from sgdjob_trainer import adapt


def arguments() -> argparse.Namespace:
    """The run's arguments (lightning_hierarchy_script.py takes the same); this rank's node named
    after its local rank, two ranks a node (as the downward API sets NODE_NAME)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.005)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--after-sync", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--left", default="hierarchical", help="the mode whose way back to sync ends the run")
    os.environ["NODE_NAME"] = f"node-{int(os.environ['LOCAL_RANK']) // 2}"
    return parser.parse_args()


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The run's data (every script's the same): 4096 noisy samples of one linear map."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(4096, 1, generator=g)


def write_final(out: Path, rank: int, model: nn.Module) -> None:
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    (out / f"final{rank}.json").write_text(json.dumps(params))


class StepLog:
    """OUT/rank<R>.jsonl, one line a step: the step, the session's mode, the wall clock, the parameters and
    momentum (and, where the script says, the epoch and the batch's sample indices). `record` says when
    to stop: `after_sync` steps after the session came back to sync from `left` (every rank sees the
    switch at the same step). The test scripts share it."""

    def __init__(self, out: Path, rank: int, after_sync: int, left: str = "hierarchical") -> None:
        self.file = (out / f"rank{rank}.jsonl").open("w")
        self.after_sync, self.left = after_sync, left
        self.was_away = False
        self.back_at: int | None = None

    def record(
        self,
        step: int,
        mode: str,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        epoch: int | None = None,
        indices: list[int] | None = None,
        came_back: int | None = None,
    ) -> bool:
        """Write the step's line; whether to stop. `came_back`: the step the session's switch back to sync
        was made at (its record's), where the first line in sync may be a later step: in async a rank
        that met the others at its epoch's end logs no line at the meeting's step."""
        # None before the rank's optimizer has stepped itself (a job that starts in async: its state is
        # on the servers until the ranks meet).
        state = [optimizer.state[p].get("momentum_buffer") for p in params]
        momentum = [m.flatten().tolist() if m is not None else None for m in state]
        flat = torch.cat([p.detach().flatten() for p in params]).tolist()
        doc = {"step": step, "mode": mode, "t": time.time(), "params": flat, "momentum": momentum}
        if indices is not None:
            doc |= {"epoch": epoch, "indices": indices}
        self.file.write(json.dumps(doc) + "\n")
        self.file.flush()
        self.was_away = self.was_away or mode == self.left
        if self.back_at is None and self.was_away and mode == "sync":
            self.back_at = step if came_back is None else came_back
        return self.back_at is not None and step >= self.back_at + self.after_sync


def momentum_session() -> tuple[DDP, torch.optim.Optimizer, adapt.Session]:
    """Collective: the plain scripts' DDP model (one linear layer), its SGD with momentum (state for a
    switch to carry) and their session, which checkpoints both."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    def save(path: str) -> None:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)

    def load(path: str) -> None:
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return model, optimizer, adapt.start(model, optimizer=optimizer, save=save, load=load)


def main() -> None:
    args = arguments()
    faulthandler.dump_traceback_later(80, exit=True)  # a hang shows every thread's stack in the test's output
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (args.out / f"pid{rank}").write_text(str(os.getpid()))
    model, optimizer, session = momentum_session()
    x, y = regression_data()
    n = args.samples
    loader = session.loader(TensorDataset(x[:n], y[:n], torch.arange(n)), batch_size=8, shuffle=True, seed=0)
    pause = args.slow_seconds if rank == args.slow_rank else args.step_seconds
    loss_fn = nn.MSELoss()
    log = StepLog(args.out, rank, args.after_sync, left=args.left)
    done = False
    # In async another rank's end may come at this rank's epoch's end, and a meeting there may bring its
    # step count to --max-steps (the most any rank took): both end the loop before another step.
    while not done and not session.ending and session.step_count < args.max_steps:
        epoch = loader.epoch
        for xb, yb, ib in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            time.sleep(pause)
            loss.backward()
            optimizer.step()
            session.step(loss)
            mode = session.telemetry.mode.value
            back = next((s.step for s in session.telemetry.switches if s.to_mode.value == "sync"), None)
            params = list(model.parameters())
            done = log.record(session.step_count, mode, params, optimizer, epoch, ib.tolist(), came_back=back)
            done = done or session.step_count >= args.max_steps
            if done:
                break
    session.finish()
    write_final(args.out, rank, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
