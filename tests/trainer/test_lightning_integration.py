"""sgdjob_trainer.integrations.lightning: the settings it refuses by name, the torchrun layout it
gives Lightning, the DataLoader arguments it carries over to the session's loader, the loader's epochs
as Lightning takes them, and, on 2 real torchrun ranks (gloo), that a rebalanced split of one global
batch moves the model exactly as the equal split does, and without the hook's weights it would not.
Skipped only without the `lightning` extra."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

pytest.importorskip("lightning", reason="the lightning extra is not installed: pip install -e .[lightning]")

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from sgdjob_trainer.adapt.loader import AdaptiveLoader
from sgdjob_trainer.adapt.split import Position, Split
from sgdjob_trainer.integrations.lightning import SGDJobTrainer, _WholeEpochs, loader_arguments, torchrun_layout
from tests.trainer.two_ranks import results_of

SCRIPT = Path(__file__).with_name("lightning_weighting_script.py")
DATA = TensorDataset(torch.arange(10).float())


def test_the_layout_is_torchruns_and_a_different_one_is_refused_by_name() -> None:
    assert torchrun_layout({}) == {"devices": 1, "num_nodes": 1}
    env = {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}
    assert torchrun_layout(env, devices="auto", num_nodes=3) == {"devices": 2, "num_nodes": 3}
    with pytest.raises(ValueError, match=r"num_nodes=1 is not supported: torchrun started 6 processes"):
        torchrun_layout(env, num_nodes=1)
    with pytest.raises(ValueError, match="WORLD_SIZE=5 is not a multiple of LOCAL_WORLD_SIZE=2"):
        torchrun_layout({"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"accumulate_grad_batches": 4}, "accumulate_grad_batches=4"),
        ({"strategy": "fsdp"}, "strategy='fsdp'"),
        ({"devices": 2}, "devices=2"),
    ],
)
def test_a_setting_the_integration_cannot_follow_is_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"SGDJobTrainer: {named} is not supported"):
        SGDJobTrainer(accelerator="cpu", **kwargs)


def test_fit_from_a_checkpoint_of_ones_own_is_refused(tmp_path: Path) -> None:
    trainer = SGDJobTrainer(accelerator="cpu", logger=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"fit\(ckpt_path='last.ckpt'\) is not supported"):
        trainer.fit(SimpleNamespace(), ckpt_path="last.ckpt")  # type: ignore[arg-type]


def test_the_dataloaders_order_and_workers_carry_over() -> None:
    sampled = DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, 2, 0, shuffle=True, seed=7))
    assert loader_arguments(sampled)[:2] == (True, 7)
    shuffle, seed, extra = loader_arguments(DataLoader(DATA, batch_size=2, shuffle=False))
    assert (shuffle, seed) == (False, 0) and "prefetch_factor" not in extra and extra["num_workers"] == 0
    workers = loader_arguments(DataLoader(DATA, batch_size=2, shuffle=True, num_workers=2, prefetch_factor=3))
    assert workers[0] is True and workers[2]["prefetch_factor"] == 3 and workers[2]["persistent_workers"] is False
    own = BatchSampler(SequentialSampler(DATA), 3, drop_last=False)

    class Mine(BatchSampler):
        pass

    with pytest.raises(ValueError, match="batch_sampler Mine is not supported"):
        loader_arguments(DataLoader(DATA, batch_sampler=Mine(SequentialSampler(DATA), 3, drop_last=False)))
    assert loader_arguments(DataLoader(DATA, batch_sampler=own))[0] is False
    with pytest.raises(ValueError, match="sampler list is not supported"):
        loader_arguments(DataLoader(DATA, batch_size=2, sampler=[0, 1, 2]))


def test_an_epoch_lightning_stops_at_its_length_is_ended_before_the_next() -> None:
    """Lightning takes `len` batches and never asks for more; the next epoch must still yield a whole one."""
    split = Split.of(1, 4)
    loader = AdaptiveLoader(
        DATA, rank=0, split=split, position=Position(), shuffle=False, seed=0, lag=0,
        on_fetch=lambda: None, on_batch=lambda size, weight: None,
    )  # fmt: skip
    session = SimpleNamespace(split=split)
    epochs = _WholeEpochs(loader, session, DATA)  # type: ignore[arg-type]
    assert len(epochs) == 2  # 10 samples, global batch 4: the remainder is dropped
    for _ in range(2):
        batches = iter(epochs)
        taken = [next(batches)[0].tolist() for _ in range(len(epochs))]
        assert taken == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert loader.epoch == 1
    # A checkpoint now resumes at the next epoch, 4 global batches taken.
    assert epochs.state_dict() == {"position": Position(epoch=2, cursor=0, batch=4).as_dict()}


class _Regression(L.LightningModule):
    """Notes the type of the training loader it trains on and the validation batch sizes it sees."""

    data: TensorDataset

    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.data, self.net = data, torch.nn.Linear(4, 1)
        self.reload_with: TensorDataset | None = None  # the dataset of the loaders after the first
        self.loaders: set[str] = set()
        self.validated: set[int] = set()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.loaders.add(type(self.trainer.train_dataloader).__name__)
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.validated.add(len(batch[0]))

    def train_dataloader(self) -> DataLoader[Any]:
        data, self.data = self.data, self.reload_with or self.data
        return DataLoader(data, batch_size=8, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_one_process_trains_whole_epochs_leaves_validation_alone_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SGDJOB_RUN_CONFIG", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SGDJOB_METRICS_PORT", "0")
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    validation = DataLoader(TensorDataset(torch.randn(20, 4), torch.randn(20, 1)), batch_size=5)
    settings = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                "enable_checkpointing": False, "reload_dataloaders_every_n_epochs": 1,
                "default_root_dir": str(tmp_path)}  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _Regression(data)
        trainer = SGDJobTrainer(max_epochs=2, **settings)
        trainer.fit(model, val_dataloaders=validation)
        # 2 epochs of 64 // 8 batches; the reloaded loader is the session's; validation keeps its batches.
        assert (trainer.global_step, trainer.sgdjob.step_count) == (16, 16)
        assert model.loaders == {"_WholeEpochs"} and model.validated == {5}
        resumed = SGDJobTrainer(max_epochs=3, **settings)
        resumed.fit(_Regression(data), val_dataloaders=validation)  # from the session's checkpoint of step 16
        assert (resumed.global_step, resumed.current_epoch) == (24, 3)
        another = _Regression(data)
        another.reload_with = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        with pytest.raises(ValueError, match=r"a new training dataset after the first \(reload_dataloaders"):
            SGDJobTrainer(max_epochs=5, **settings).fit(another, val_dataloaders=validation)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_an_unequal_split_moves_the_model_as_the_equal_split_does(tmp_path: Path) -> None:
    results = results_of(SCRIPT, tmp_path)
    assert results["24+8"] == pytest.approx(results["16+16"], rel=1e-5, abs=1e-5)
    # The control: without the weights, DDP's plain average of the unequal batches moves it elsewhere.
    assert results["unweighted"] != pytest.approx(results["16+16"], rel=1e-5, abs=1e-5)
