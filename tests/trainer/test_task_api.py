"""The task API and the optimizer machinery, without processes: what a user's task may return, the
errors a user will make, the flat optimizer state every mode shares, the parameter-server shard
running the job's own optimizer, and the sharding rule for streaming data."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from sgdjob_trainer.config import AsyncConfig, StalenessLr, TrainingConfig
from sgdjob_trainer.data import DataPosition, rebase
from sgdjob_trainer.optim import (
    OptimizerTemplate,
    build_optimizer,
    check_optimizer,
    flat_state,
    load_flat_state,
    remember_base_lrs,
    set_lr,
    slice_state,
)
from sgdjob_trainer.strategies.ps import Shard
from sgdjob_trainer.streaming import IterableStream
from sgdjob_trainer.task import Task, load_task, resolve_task


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _step(optimizer: torch.optim.Optimizer, model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()


class Counting(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A stream of `n` items whose input is its own position (so a trace can be checked)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(i % 3)


def _install(name: str, **attrs: Any) -> str:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return name


# -- configuration ----------------------------------------------------------------------------------
def test_declarative_optimizer_and_its_errors_name_the_field() -> None:
    cfg = TrainingConfig.model_validate(
        {"optimizer": {"name": "adamw", "betas": [0.9, 0.95], "weightDecay": 0.1}, "learningRate": 0.003}
    )
    opt = build_optimizer(cfg, _model())
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.9, 0.95)
    # Weight decay on the two weight matrices only, never on biases.
    decayed = [g for g in opt.param_groups if g["weight_decay"] > 0]
    assert len(decayed) == 1 and all(p.dim() == 2 for p in decayed[0]["params"])
    with pytest.raises(ValidationError, match=r"momentum is SGD's; adam uses optimizer\.betas"):
        TrainingConfig.model_validate({"optimizer": {"name": "adam"}, "momentum": 0.9})
    with pytest.raises(ValidationError, match="nesterov"):
        TrainingConfig.model_validate({"optimizer": {"nesterov": True}})
    with pytest.raises(ValidationError, match=r"training\.task provides the model; remove training\.model"):
        TrainingConfig.model_validate({"task": "pkg.mod:build", "model": "digits-mlp"})
    with pytest.raises(ValidationError, match="betas"):
        TrainingConfig.model_validate({"optimizer": {"name": "adam", "betas": [0.9]}})


# -- the task hook ----------------------------------------------------------------------------------
def test_a_task_hook_is_loaded_seeded_and_checked() -> None:
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    draws: list[float] = []

    def build() -> Task:
        draws.append(float(torch.rand(())))
        return Task(model=_model(), train_data=data, loss=F.cross_entropy)

    spec = _install("sgdjob_test_task_ok", build=build) + ":build"
    task = load_task(spec, seed=7)
    load_task(spec, seed=7)
    assert draws[0] == draws[1], "seeded before the call, so every rank builds the same thing"
    assert task.is_classification() and not Task(model=_model(), train_data=data, loss=F.mse_loss).is_classification()
    cfg = TrainingConfig.model_validate({"task": spec})
    assert resolve_task(cfg).train_data is data


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({}, "cannot import 'sgdjob_test_task_bad:build'"),
        ({"build": 3}, "is a int, not a function returning a Task"),
        ({"build": lambda: nn.Linear(2, 2)}, "returned Linear; return sgdjob_trainer.task.Task"),
        (
            {"build": lambda: Task(model=nn.Linear(2, 2), train_data=[1, 2, 3][0:0] or 5, loss=F.mse_loss)},  # type: ignore[arg-type]
            "train_data of type int",
        ),
        (
            {"build": lambda: Task(model=nn.Linear(1, 1), train_data=Counting(10), loss=F.mse_loss)},
            "gives no validation_data",
        ),
    ],
)
def test_task_mistakes_get_a_message_with_the_fix(attrs: dict[str, Any], message: str) -> None:
    spec = _install("sgdjob_test_task_bad", **attrs) + ":build"
    with pytest.raises((ValueError, TypeError), match=r"training\.task") as err:
        load_task(spec, seed=0)
    assert message in str(err.value)


def test_a_task_optimizer_must_cover_the_model_and_take_no_closure() -> None:
    model = _model()
    first = list(model.parameters())[:2]
    with pytest.raises(ValueError, match="2 missing"):
        check_optimizer(torch.optim.SGD(first, lr=0.1), model, "training.task 'x'")
    with pytest.raises(ValueError, match="LBFGS needs a closure"):
        check_optimizer(torch.optim.LBFGS(model.parameters()), model, "training.task 'x'")
    with pytest.raises(TypeError, match=r"not a torch\.optim\.Optimizer"):
        check_optimizer(object(), model, "training.task 'x'")


# -- the optimizer's state between modes ------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_flat_state_round_trips_and_shards_reproduce_the_whole_step(cls: type[torch.optim.Optimizer]) -> None:
    """Two optimizers over slices of the flat parameter vector, loaded with slices of the state,
    take exactly the step the whole optimizer takes: what async's shards rely on."""
    kwargs: dict[str, Any] = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    model = _model()
    params = list(model.parameters())
    opt = cls([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:]}], lr=0.01, **kwargs)
    remember_base_lrs(opt)
    for seed in range(3):
        _step(opt, model, seed)
    state = flat_state(opt, params)
    assert state and all(v.dim() == 0 or v.numel() == sum(p.numel() for p in params) for v in state.values())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    template = OptimizerTemplate(opt, params)
    cut = 37  # inside the first layer's weight: a parameter split between two shards
    shards = []
    for lo, hi in ((0, cut), (cut, flat.numel())):
        buffer = flat[lo:hi].clone()
        shard_opt, views = template.build(lo, hi, buffer)
        load_flat_state(shard_opt, views, slice_state(state, lo, hi))
        shards.append((lo, hi, buffer, shard_opt, views))
    _step(opt, model, 99)
    grad = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    for lo, _, _, shard_opt, views in shards:
        at = lo
        for view in views:
            view.grad = grad[at : at + view.numel()]
            at += view.numel()
        set_lr(shard_opt, 1.0)
        shard_opt.step()
    whole = torch.cat([p.detach().reshape(-1) for p in params])
    sharded = torch.cat([buffer for _, _, buffer, _, _ in shards])
    assert torch.allclose(whole, sharded, atol=1e-7)
    # And back: the shards' state reassembled equals the whole optimizer's.
    back = {k: torch.cat([flat_state(o, v)[k] for _, _, _, o, v in shards]) for k in state if state[k].dim() > 0}
    after = flat_state(opt, params)
    assert all(torch.allclose(back[k], after[k]) for k in back)


def test_factored_state_cannot_be_sharded_and_says_what_to_do() -> None:
    model = _model()
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    _step(opt, model, 0)
    with pytest.raises(ValueError, match=r"not elementwise, so async mode cannot shard it.*sync/hierarchical"):
        flat_state(opt, list(model.parameters()))


def test_a_shard_checkpoint_restores_adam_exactly() -> None:
    param = torch.zeros(6, requires_grad=True)
    opt = torch.optim.AdamW([param], lr=0.1)
    remember_base_lrs(opt)
    cfg = AsyncConfig(staleness=None, staleness_lr=StalenessLr.SQRT)
    first = Shard(0, 6, 2, cfg, OptimizerTemplate(opt, [param]))
    first.load(torch.ones(6), 1.0, 8, {})
    out = torch.zeros(6)
    for i in range(5):
        first.apply(i % 2, torch.linspace(-1, 1, 6) * (i + 1), 4, out)
    saved = first.snapshot()
    assert set(saved["state"]) == {"step", "exp_avg", "exp_avg_sq"} and float(saved["state"]["step"]) == 5
    second = Shard(0, 6, 2, cfg, OptimizerTemplate(opt, [param]))
    second.load(saved["params"], 1.0, 8, {})
    assert second.restore(saved) and second.version == first.version
    a, b = torch.zeros(6), torch.zeros(6)
    first.apply(0, torch.ones(6), 4, a)
    second.apply(0, torch.ones(6), 4, b)
    assert torch.equal(a, b)


# -- streaming data ---------------------------------------------------------------------------------
def test_a_stream_is_read_exactly_once_per_epoch_within_a_world() -> None:
    world, batch = 3, 4
    data = Counting(50)
    streams = [IterableStream(data, r, world) for r in range(world)]
    for s in streams:
        s.trace = []
    for _ in range(4):  # 4 batches of 4 per rank: 48 of the 50 positions
        for s in streams:
            x, _ = s.next_batch(batch)
            assert x.shape == (batch, 1)
    seen = [i for s in streams for i in s.trace or []]
    assert sorted(seen) == list(range(48)), "disjoint, and together every position"
    x, _ = streams[0].next_batch(batch)  # rank 0's epoch 0 share is used up: epoch 1 from its start
    assert streams[0].position.epoch == 1 and x.flatten().tolist() == [0.0, 3.0, 6.0, 9.0]
    assert 1 in data.epochs, "set_epoch lets the dataset reshuffle"


def test_a_stream_resumed_in_another_world_skips_nothing() -> None:
    """Ranks at different offsets (async): the new world re-reads, never skips (at least once)."""
    data = Counting(200)
    old = [IterableStream(data, r, 4) for r in range(4)]
    read: set[int] = set()
    for r, s in enumerate(old):
        s.trace = []
        for _ in range(r + 1):
            s.next_batch(2)
        read |= set(s.trace)
    start = rebase([s.position for s in old])
    new = [IterableStream(data, r, 3, DataPosition(start.epoch, start.offset, start.base)) for r in range(3)]
    later: set[int] = set()
    for s in new:
        s.trace = []
        s.next_batch(10)
        later |= set(s.trace)
    assert set(range(max(read) + 1)) <= read | later, "no position skipped"
    assert min(later) == start.base == 8


def test_a_stream_too_short_for_a_batch_names_the_fix() -> None:
    stream = IterableStream(Counting(5), 0, 2)
    with pytest.raises(ValueError, match=r"fewer than 4 items \(batchSize\).*smaller batchSize"):
        stream.next_batch(4)


class _Factored(torch.optim.Optimizer):
    """A user's optimizer with one running scale per row: state SGDJob cannot slice elementwise."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                row = self.state[p].setdefault("row", torch.zeros(p.shape[0]))
                row.add_(p.grad.reshape(p.shape[0], -1).pow(2).mean(dim=1))  # type: ignore[union-attr]
                p.data.add_(p.grad, alpha=-group["lr"])  # type: ignore[arg-type]


def test_what_async_cannot_run_is_known_before_it_is_tried() -> None:
    from sgdjob_trainer.optim import async_obstacle

    model = _model()
    params = list(model.parameters())
    assert async_obstacle(torch.optim.AdamW(params), params) is None
    factored = torch.optim.Adafactor(params)
    assert "factored" in (async_obstacle(factored, params) or ""), "known before its first step"
    own = _Factored([p for p in params if p.dim() == 2])
    assert async_obstacle(own, params) is None, "an unknown optimizer without state: not yet judged"
    _step(own, model, 0)
    assert "not elementwise" in (async_obstacle(own, [p for p in params if p.dim() == 2]) or "")


# -- mistakes only a real world shows (two processes, gloo) -------------------------------------------
def rank_dependent_task() -> Task:
    """A task that builds a wider model on rank 1: the mistake same_model catches."""
    import os

    width = 8 if os.environ.get("RANK") == "0" else 16
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
    return Task(model=nn.Sequential(nn.Linear(4, width), nn.Linear(width, 3)), train_data=data, loss=F.cross_entropy)


def tiny_data_task() -> Task:
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    return Task(model=_model(), train_data=data, loss=F.cross_entropy)


def _assemble_child(rank: int, port: int, out: str) -> None:
    import json
    import os

    import torch.distributed as dist

    from bench.trainer_modes import spawned_rank_env
    from sgdjob_trainer.assembly import assemble
    from sgdjob_trainer.runtime import WorldInfo

    spawned_rank_env(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    errors = {}
    for name, training in (
        ("differs", {"task": "tests.trainer.test_task_api:rank_dependent_task"}),
        ("tiny", {"task": "tests.trainer.test_task_api:tiny_data_task", "batchSize": 8}),
    ):
        try:
            assemble(TrainingConfig.model_validate(training), WorldInfo.from_env(), torch.device("cpu"),
                     DataPosition(), None)  # fmt: skip
            errors[name] = ""
        except ValueError as err:
            errors[name] = str(err)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_a_model_that_differs_between_ranks_or_data_too_small_is_refused(tmp_path: Any) -> None:
    import json

    import torch.multiprocessing as mp

    from bench.trainer_modes import free_port_base

    mp.spawn(_assemble_child, args=(free_port_base(1), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        errors = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "the model differs between ranks" in errors["differs"] and "training.task" in errors["differs"]
        assert errors["tiny"].startswith("training.batchSize:") and "fewer than batchSize 8" in errors["tiny"]
