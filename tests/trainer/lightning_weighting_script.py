"""Run by tests/trainer/test_lightning_integration.py under torchrun (2 gloo ranks): one SGD step of
SGDJobTrainer on one global batch of 32, split 16+16 and 24+8 (the session's DDP hook weighs the
ranks' mean gradients by their shares), and 24+8 without the hook's weights (the control: DDP's plain
average); rank 0 prints each case's parameters after the step (sum and sum of squares of each tensor)
as one line of JSON."""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sgdjob_trainer.adapt.split import Split
from sgdjob_trainer.integrations.lightning import SGDJobCallback, SGDJobTrainer


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1.0)


class Resplit(L.Callback):
    """Before the first batch: the split, as a control command applied at a step boundary makes it."""

    def __init__(self, sizes: dict[int, int], weigh: bool) -> None:
        self.sizes, self.weigh = sizes, weigh

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        session = SGDJobCallback.session_of(trainer)
        assert session.loader_made is not None
        session.split = Split.of(dist.get_world_size(), 16, self.sizes)
        session.loader_made.resplit(session.split)
        if not self.weigh:  # the control case: the hook keeps weight 1, DDP's plain average
            session.loader_made._on_batch = lambda size, weight: None


def one_step(sizes: dict[int, int], out: str, weigh: bool = True) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
    model = Regression()
    trainer = SGDJobTrainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Resplit(sizes, weigh)], sgdjob_checkpoint_dir=out,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=False))
    params = [p.detach().double() for p in model.parameters()]
    return [round(float(v), 6) for p in params for v in (p.sum(), p.square().sum())]


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for sizes in ({0: 16, 1: 16}, {0: 24, 1: 8}):
            key = f"{sizes[0]}+{sizes[1]}"
            results[key] = one_step(sizes, f"{out}/{key}")
        results["unweighted"] = one_step({0: 24, 1: 8}, f"{out}/unweighted", weigh=False)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
