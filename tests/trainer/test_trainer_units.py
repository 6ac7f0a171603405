"""Single-process tests of the trainer's parts: data, models, emulation, PS shard rule, control inbox."""

from __future__ import annotations

import math
import subprocess
import sys
import types

import pytest
import torch

from sgdjob_trainer.config import AsyncConfig, Emulation, SpeedChange, StalenessLr
from sgdjob_trainer.data import SYNTHETIC_NOISE_FLOOR, ShardedStream, build_dataset, digits_dataset, synthetic_dataset
from sgdjob_trainer.emulation import ComputeEmulator
from sgdjob_trainer.hooks import load_hook
from sgdjob_trainer.networks import build_loss, build_model
from sgdjob_trainer.optim import OptimizerTemplate, async_momentum, remember_base_lrs
from sgdjob_trainer.server import ControlInbox
from sgdjob_trainer.strategies.hierarchical import group_by_node, group_by_speed, valid_groups
from sgdjob_trainer.strategies.ps import Shard, damping
from sgdjob_trainer.wire.control import ControlCommand


def test_synthetic_teacher_has_known_noise_floor() -> None:
    ds = synthetic_dataset()
    x, y = ds.tensors
    # The least-squares fit of the linear teacher reaches the noise floor and no lower.
    design = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    solution = torch.linalg.lstsq(design, y).solution
    mse = float(((design @ solution - y) ** 2).mean())
    assert mse == pytest.approx(SYNTHETIC_NOISE_FLOOR, rel=0.1)
    assert torch.equal(x, synthetic_dataset().tensors[0]), "same data whatever the run"


def test_digits_ships_with_the_package() -> None:
    x, y = digits_dataset().tensors
    assert x.shape == (1797, 64) and float(x.max()) <= 1.0
    assert y.dtype == torch.long and set(y.tolist()) == set(range(10))


def test_digits_load_without_importing_scikit_learn() -> None:
    """A worker reads the digits at every start and restart; importing scikit-learn for them cost
    ~1.1 s of CPU, most of a restart on a CPU-limited node. Same table as scikit-learn's loader."""
    probe = (
        "import sys; from sgdjob_trainer.data import digits_dataset; x, y = digits_dataset().tensors; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = digits_dataset().tensors
    assert torch.equal(x, torch.tensor(bunch.data, dtype=torch.float32) / 16.0)
    assert torch.equal(y, torch.tensor(bunch.target, dtype=torch.long))


@pytest.mark.parametrize(
    ("model", "dataset", "out"), [("mlp", "synthetic", 1), ("digits-mlp", "digits", 10), ("digits-cnn", "digits", 10)]
)
def test_builtin_models_fit_their_data(model: str, dataset: str, out: int) -> None:
    ds = build_dataset(dataset)
    x, y = ds[0:8]
    net = build_model(model, seed=3)
    assert net(x).shape == (8, out)
    loss = build_loss("auto", dataset, y)(net(x), y)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    same = build_model(model, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), same.parameters(), strict=True))


def test_user_hooks_resolve() -> None:
    mod = types.ModuleType("sgdjob_test_hooks")
    mod.model = lambda: torch.nn.Linear(4, 2)  # type: ignore[attr-defined]
    mod.data = lambda: torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randint(0, 2, (10,)))  # type: ignore[attr-defined]
    sys.modules["sgdjob_test_hooks"] = mod
    try:
        assert isinstance(build_model("sgdjob_test_hooks:model", 0), torch.nn.Linear)
        ds = build_dataset("sgdjob_test_hooks:data")
        assert len(ds) == 10  # type: ignore[arg-type]
        # A loss hook is the loss itself; auto picks cross-entropy for integer targets.
        assert build_loss("torch.nn.functional:l1_loss", "x:y", torch.zeros(1)) is torch.nn.functional.l1_loss
        assert (
            build_loss("auto", "sgdjob_test_hooks:data", torch.zeros(2, dtype=torch.long))
            is torch.nn.functional.cross_entropy
        )
        with pytest.raises(ValueError, match="no attribute"):
            load_hook("sgdjob_test_hooks:missing")
    finally:
        del sys.modules["sgdjob_test_hooks"]


def test_shards_are_disjoint_deterministic_and_reshard() -> None:
    ds = synthetic_dataset()
    streams = [ShardedStream(ds, r, 4, seed=7) for r in range(4)]
    seen = [set(s._shard_for(0).tolist()) for s in streams]
    assert sum(len(s) for s in seen) == len(ds) and len(set().union(*seen)) == len(ds)
    a, b = ShardedStream(ds, 1, 4, seed=7), ShardedStream(ds, 1, 4, seed=7)
    assert torch.equal(a.next_batch(16)[0], b.next_batch(16)[0])
    assert not torch.equal(a._shard_for(0), a._shard_for(1)), "a new permutation each epoch"
    for _ in range(len(ds) // 4 // 32 + 1):
        b.next_batch(32)
    assert b.position.epoch == 1, "rolls into the next epoch"


def test_emulation_factor_and_batch_scaling() -> None:
    emu = Emulation(
        compute_seconds=0.1,
        slowdowns=[SpeedChange(rank=1, factor=3.0, start_step=5, end_step=10), SpeedChange(node="n2", factor=2.0)],
    )
    slow = ComputeEmulator(emu, rank=1, node="n2", reference_batch=32, seed=0)
    assert slow.factor(0) == 2.0 and slow.factor(5) == 6.0 and slow.factor(10) == 2.0
    assert slow.seconds(5, 16) == pytest.approx(0.1 * 6.0 * 0.5)
    assert ComputeEmulator(None, 0, "n", 32, 0).seconds(0, 32) == 0.0
    jittery = ComputeEmulator(Emulation(compute_seconds=1.0, jitter=0.1), 0, "n", 32, 0)
    values = [jittery.seconds(0, 32) for _ in range(50)]
    assert all(0.9 <= v <= 1.1 for v in values) and len(set(values)) > 1


def _sgd_template(numel: int) -> OptimizerTemplate:
    """Plain SGD at rate 1 over one parameter of `numel` elements."""
    param = torch.zeros(numel, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=1.0)
    remember_base_lrs(optimizer)
    return OptimizerTemplate(optimizer, [param])


def test_ps_shard_damps_by_staleness_and_discards_beyond_bound() -> None:
    assert damping(StalenessLr.SQRT, 3.0) == pytest.approx(0.5)
    assert damping(StalenessLr.INVERSE, 3.0) == pytest.approx(0.25)
    cfg = AsyncConfig(staleness=2, staleness_lr=StalenessLr.INVERSE)
    shard = Shard(0, 2, world_size=4, cfg=cfg, template=_sgd_template(2))
    shard.load(torch.zeros(2), lr_scale=1.0, total_batch=128, state={})
    out = torch.zeros(2)
    fresh = shard.apply(0, torch.ones(2), 32, out)
    assert fresh.applied and fresh.staleness == 0 and out.tolist() == [-0.25, -0.25]
    for _ in range(3):
        shard.apply(1, torch.zeros(2), 32, out)  # three updates by others: worker 0 is 1 step stale
    stale = shard.apply(0, torch.ones(2), 32, out)
    assert stale.applied and stale.staleness == pytest.approx(1.0)
    assert out.tolist() == pytest.approx([-0.25 - 0.25 / 2] * 2)
    for _ in range(9):
        shard.apply(2, torch.zeros(2), 32, out)
    dropped = shard.apply(0, torch.ones(2), 32, out)
    assert not dropped.applied and dropped.staleness == pytest.approx(3.0), "beyond the bound: discarded"
    assert out.tolist() == pytest.approx([-0.375] * 2), "and the worker gets the fresh model"
    asp = Shard(0, 1, 4, AsyncConfig(staleness=None), _sgd_template(1))
    asp.load(torch.zeros(1), 1.0, 4, {})
    for _ in range(30):
        asp.apply(1, torch.zeros(1), 1, out[:1])
    assert asp.apply(0, torch.ones(1), 1, out[:1]).applied, "ASP applies everything"


def test_ps_shard_lowers_a_sync_tuned_momentum_for_asynchrony() -> None:
    """Three workers' stale pushes add momentum of their own: the servers apply 1 - 3 x (1 - 0.9) =
    0.7 of the job's 0.9 unless training.async.momentum says otherwise; Adam is left as it is."""
    assert async_momentum(0.9, 3, None) == pytest.approx(0.7)
    assert async_momentum(0.9, 20, None) == 0.0, "floored at no momentum"
    assert async_momentum(0.95, 1, None) == pytest.approx(0.95), "one worker: nothing is stale"
    assert async_momentum(0.0, 3, None) == 0.0 and async_momentum(0.9, 3, 0.85) == 0.85

    def two_pushes(cfg: AsyncConfig) -> float:
        param = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.SGD([param], lr=1.0, momentum=0.9)
        remember_base_lrs(optimizer)
        shard = Shard(0, 1, world_size=3, cfg=cfg, template=OptimizerTemplate(optimizer, [param]))
        shard.load(torch.zeros(1), lr_scale=1.0, total_batch=8, state={})
        out = torch.zeros(1)
        shard.apply(0, torch.ones(1), 8, out)
        shard.apply(1, torch.ones(1), 8, out)  # momentum m carries the first push: -(1 + (1 + m))
        assert optimizer.param_groups[0]["momentum"] == 0.9, "the workers' own optimizer keeps the job's"
        return float(out[0])

    assert two_pushes(AsyncConfig(staleness_lr=StalenessLr.NONE)) == pytest.approx(-2.7)
    assert two_pushes(AsyncConfig(staleness_lr=StalenessLr.NONE, momentum=0.9)) == pytest.approx(-2.9)
    param = torch.zeros(2, requires_grad=True)
    adam = torch.optim.Adam([param], lr=0.1, betas=(0.9, 0.99))
    remember_base_lrs(adam)
    shard = Shard(0, 2, 3, AsyncConfig(), OptimizerTemplate(adam, [param]))
    assert shard.opt.param_groups[0]["betas"] == (0.9, 0.99)


def test_groups() -> None:
    assert group_by_speed([10.0, 10.5, 9.8, 3.3]) == [[0, 1, 2], [3]]
    assert group_by_speed([1.0, 1.0, 1.0, 1.0]) == [[0, 1, 2, 3]]
    assert group_by_node(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert (
        valid_groups([[0, 1], [2, 3]], 4)
        and not valid_groups([[0, 1], [2]], 4)
        and not valid_groups([[0, 1], [1, 2, 3]], 4)
    )


def test_control_inbox_orders_and_merges() -> None:
    inbox = ControlInbox()
    assert inbox.offer(ControlCommand(epoch=2, mode="async", reason="a"))
    assert not inbox.offer(ControlCommand(epoch=2, mode="async")), "re-push of the same epoch is ignored"
    assert inbox.offer(ControlCommand(epoch=3, batch_sizes={3: 16}))
    assert inbox.pending_epoch() == 3
    merged = inbox.take()
    assert merged is not None and merged.mode == "async" and merged.batch_sizes == {3: 16} and merged.epoch == 3
    assert inbox.take() is None and inbox.applied_epoch == 3
    assert not inbox.offer(ControlCommand(epoch=1, mode="sync")), "older than applied"
