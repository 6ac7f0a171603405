"""The job's optimizer: built from `training.optimizer` or taken from the task, checked, and its
state moved between modes.

Learning rates: each parameter group remembers the rate it was built with (`BASE_LR`, the rate at
the reference world size); every update sets `lr = base x world-size factor x schedule(step)`, so
parameter groups with different rates keep their ratios.

Optimizer state across modes: sync, hierarchical and async all run the same optimizer (async runs
one copy per parameter-server shard over its slice of the parameters). State moves between them in
a flat form, `FlatState`: each elementwise entry (a tensor shaped like its parameter: momentum,
Adam's moments) becomes one vector over all trainable parameters in model order, and each scalar
entry (Adam's step count) one 0-dim tensor. Sharding a `FlatState` is slicing its vectors, so a
switch carries Adam's moments into the shards and back without a reset. An optimizer whose state
is neither (Adafactor's factored moments) cannot be sharded: `flat_state` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sgdjob_trainer.config import OptimizerName, TrainingConfig

BASE_LR = "sgdjob_base_lr"
FlatState = dict[str, torch.Tensor]


def build_optimizer(training: TrainingConfig, model: nn.Module) -> torch.optim.Optimizer:
    """`training.optimizer` over the model's trainable parameters; weight decay on weights of 2+
    dimensions only (biases and normalisation scales are not decayed)."""
    cfg = training.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    plain = [p for p in trainable if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        g
        for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0})
        if g["params"]
    ]
    lr = training.learning_rate
    if cfg.name == OptimizerName.SGD:
        return torch.optim.SGD(groups, lr=lr, momentum=training.momentum, nesterov=cfg.nesterov)
    betas = (cfg.betas[0], cfg.betas[1])
    if cfg.name == OptimizerName.ADAM:
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps)


def check_optimizer(optimizer: object, model: nn.Module, where: str) -> torch.optim.Optimizer:
    """The optimizer a task built, checked: a torch optimizer that takes no closure, over exactly
    the model's trainable parameters, each once."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: the optimizer function returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"{where}: LBFGS needs a closure that re-evaluates the loss; SGDJob steps without one")
    seen = [id(p) for g in optimizer.param_groups for p in g["params"]]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if len(seen) != len(set(seen)):
        raise ValueError(f"{where}: a parameter appears in more than one parameter group")
    if set(seen) != trainable:
        missing, extra = len(trainable - set(seen)), len(set(seen) - trainable)
        raise ValueError(
            f"{where}: the optimizer must cover exactly the model's trainable parameters "
            f"({missing} missing, {extra} not in the model); build it from model.parameters()"
        )
    return optimizer


def remember_base_lrs(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        group.setdefault(BASE_LR, float(group["lr"]))


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Every group's learning rate = its base rate x factor."""
    for group in optimizer.param_groups:
        group["lr"] = group[BASE_LR] * factor


# torch optimizers whose state is elementwise (plus step counts): async mode shards them exactly.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Rprop,
)

# Optimizers that divide each step by a running root-mean-square of the gradients (the state keys they
# keep it under, for an optimizer SGDJob does not know). Their step does not grow with the gradient, so
# a smaller or noisier update's step is not smaller the way SGD's is: see wire.metric_names.ADAPTIVE.
ADAPTIVE = (
    *(c for c in ELEMENTWISE if c not in (torch.optim.SGD, torch.optim.Rprop)),  # Rprop: full-batch sign steps
    torch.optim.Adadelta,
)
SECOND_MOMENT_KEYS = frozenset({"exp_avg_sq", "square_avg", "sum", "exp_inf"})


def adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer normalises its steps by the gradients' running magnitude (module above)."""
    if isinstance(optimizer, ADAPTIVE):
        return True
    return any(SECOND_MOMENT_KEYS & set(state) for state in optimizer.state.values())


def async_obstacle(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> str | None:
    """Why async mode cannot run this optimizer, or None. A known elementwise optimizer can; any
    other is judged by its state once it has some (before its first step it is given the benefit
    of the doubt, and entering async then checks again)."""
    if isinstance(optimizer, ELEMENTWISE):
        return None
    name = type(optimizer).__name__
    if getattr(torch.optim, "Adafactor", None) is not None and isinstance(optimizer, torch.optim.Adafactor):
        return (
            f"optimizer {name} keeps factored (row/column) moments, not elementwise state, so async mode "
            "cannot shard it over parameter servers; use an elementwise optimizer (sgd, adam, adamw, rmsprop, "
            "adagrad) or keep the job in sync/hierarchical (spec.mode)"
        )
    try:
        flat_state(optimizer, params)
    except ValueError as err:
        return str(err)
    return None


def flat_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> FlatState:
    """The optimizer's state over `params` in flat form (module doc), on the CPU."""
    numel = sum(p.numel() for p in params)
    states = [{k: _tensor(v) for k, v in optimizer.state.get(p, {}).items() if v is not None} for p in params]
    scalar_keys = {
        k for p, st in zip(params, states, strict=True) if p.dim() > 0 for k, v in st.items() if v.dim() == 0
    }
    out: FlatState = {}
    offset = 0
    for p, st in zip(params, states, strict=True):
        n = p.numel()
        for key, value in st.items():
            if key in scalar_keys:
                out.setdefault(key, value.detach().to("cpu").clone())
                continue
            if value.shape != p.shape:
                raise ValueError(
                    f"optimizer {type(optimizer).__name__} keeps '{key}' of shape {tuple(value.shape)} for a "
                    f"parameter of shape {tuple(p.shape)}: not elementwise, so async mode cannot shard it over "
                    "parameter servers; use an elementwise optimizer (sgd, adam, adamw, rmsprop, adagrad) or keep "
                    "the job in sync/hierarchical (spec.mode)"
                )
            if key not in out:
                out[key] = torch.zeros(numel, dtype=value.dtype)
            out[key][offset : offset + n] = value.detach().reshape(-1).to("cpu")
        offset += n
    return out


def load_flat_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], flat: FlatState) -> None:
    """Replace the optimizer's state over `params` with `flat` (vectors sliced per parameter)."""
    offset = 0
    for p in params:
        n = p.numel()
        state: dict[str, Any] = {}
        for key, value in flat.items():
            if value.dim() == 0:
                state[key] = value.clone()  # step counts stay on the CPU, as the optimizers keep them
            else:
                state[key] = value[offset : offset + n].view_as(p).to(p.device).clone()
        optimizer.state.pop(p, None)
        if state:
            optimizer.state[p] = state
        offset += n


def slice_state(flat: FlatState, lo: int, hi: int) -> FlatState:
    return {k: v if v.dim() == 0 else v[lo:hi].clone() for k, v in flat.items()}


def average_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Collective: every rank's state becomes the mean of all ranks' (scalars: the largest), so
    ranks that ran apart (hierarchical groups) continue with one state."""
    flat = flat_state(optimizer, params)
    shapes: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, {k: v.dim() for k, v in flat.items()})
    keys: dict[str, int] = {}
    for entry in shapes:
        keys.update(entry or {})
    numel = sum(p.numel() for p in params)
    device = params[0].device if params else torch.device("cpu")
    world = dist.get_world_size()
    averaged: FlatState = {}
    for key in sorted(keys):
        scalar = keys[key] == 0
        value = flat.get(key, torch.zeros(() if scalar else numel))
        buf = value.to(device, torch.float64 if scalar else value.dtype)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if scalar else dist.ReduceOp.SUM)
        averaged[key] = (buf if scalar else buf / world).to("cpu", value.dtype)
    load_flat_state(optimizer, params, averaged)


def async_momentum(momentum: float, workers: int, configured: float | None) -> float:
    """The SGD momentum a parameter server applies in async: `configured` (training.async.momentum)
    where set, else the job's `momentum` lowered for asynchrony's own. Each of `workers` equal workers
    pushes a gradient computed on a model about `workers - 1` pushes old, and that delay acts as
    momentum of its own (Mitliagkas et al., "Asynchrony begets momentum", 2016); on top of a momentum
    tuned for sync it overshoots and oscillates (bench/README: a DDP script's 0.9 reached the loss
    target later in async than sync did). Lowered so that a push's momentum leaves 1/workers of a
    step's memory: 1 - momentum grows `workers`-fold, floored at 0."""
    if configured is not None:
        return configured
    return max(0.0, 1.0 - workers * (1.0 - momentum))  # no momentum stays none: 1 - workers <= 0


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value))


class OptimizerTemplate:
    """How to make the job's optimizer over a slice of the flat parameter vector (a parameter-server
    shard): the optimizer's class, each group's settings, and each trainable parameter's place."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.cls = type(optimizer)
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.layout: list[tuple[int, int, int]] = []
        offset = 0
        for p in params:
            self.layout.append((offset, p.numel(), group_of[id(p)]))
            offset += p.numel()

    def build(self, lo: int, hi: int, buffer: torch.Tensor) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        """An optimizer over views of `buffer` (the flat slice [lo, hi)), one view per parameter
        piece in the slice, in model order; the views are returned in that order."""
        members: list[list[torch.Tensor]] = [[] for _ in self.groups]
        views: list[torch.Tensor] = []
        for offset, numel, group in self.layout:
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                view = buffer[a - lo : b - lo]
                members[group].append(view)
                views.append(view)
        groups = [{**self.groups[i], "params": m} for i, m in enumerate(members) if m]
        if not groups:  # an empty slice still needs an optimizer object
            placeholder = torch.zeros(0)
            groups, views = [{**self.groups[0], "params": [placeholder]}], [placeholder]
        # Optimizer subclasses take (params, **defaults); the groups carry every setting.
        return self.cls(groups), views  # type: ignore[call-arg]
