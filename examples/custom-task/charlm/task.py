"""The SGDJob task: `training.task: "charlm.task:build"`.

SGDJob calls `build()` on every rank after seeding torch; the returned Task gives the model, the
training windows, the held-out validation windows, the loss, the optimizer and a metric (bits per
character). The learning-rate schedule is not here: the job's declarative `training.lrPolicy`
(warmup, then cosine) knows the job's step count, which this module does not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from charlm.data import train_and_validation
from charlm.model import CharTransformer
from sgdjob_trainer.task import Task

# AdamW at the reference world size (minReplicas x nprocPerNode); SGDJob scales it by lrScaling.
LEARNING_RATE = 3e-3
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) over every position of every window."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def bits_per_char(output: torch.Tensor, target: torch.Tensor) -> float:
    """The loss in bits: what an ideal coder driven by the model spends per character (7 = uniform over 128)."""
    return float(loss(output, target).item()) / math.log(2)


def parameter_groups(model: nn.Module) -> list[dict[str, object]]:
    """Weight decay on the matrices of the linear layers only: not on biases and LayerNorm (scales
    and shifts, not weights to shrink) and not on the embeddings (a rare character's row would decay
    towards zero between its sightings; the head shares the token embedding, so it is spared too)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameter_groups(model), lr=LEARNING_RATE, betas=BETAS)


def build() -> Task:
    train, validation = train_and_validation()
    return Task(
        model=CharTransformer(),
        train_data=train,
        validation_data=validation,
        loss=loss,
        optimizer=optimizer,
        metric=bits_per_char,
        classification=True,
    )
