"""Built-in models and losses, and what the `module:function` user hooks (hooks.py) must be.

Hooks: a model hook is called with no arguments and returns an `nn.Module`; a dataset hook is
called with no arguments and returns a map-style dataset of `(input, target)` pairs; a loss hook IS
the loss: it is called as `loss(output, target)` and returns a scalar tensor, so
`torch.nn.functional:cross_entropy` works as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from sgdjob_trainer.data import SYNTHETIC_FEATURES
from sgdjob_trainer.hooks import load_hook

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DigitsCNN(nn.Module):
    """A small CNN for the 8x8 digits; takes the flat 64-feature rows the dataset yields."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return cast(torch.Tensor, self.head(x.flatten(1)))


def build_model(name: str, seed: int) -> nn.Module:
    """The model every rank starts from; seeded so all ranks build identical parameters."""
    torch.manual_seed(seed)
    if name == "mlp":
        # Wide enough (2x inputs) to represent the linear teacher exactly with ReLU pairs, so the
        # optimum is the synthetic data's noise floor.
        return nn.Sequential(
            nn.Linear(SYNTHETIC_FEATURES, 2 * SYNTHETIC_FEATURES), nn.ReLU(), nn.Linear(2 * SYNTHETIC_FEATURES, 1)
        )
    if name == "digits-mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if name == "digits-cnn":
        return DigitsCNN()
    model = load_hook(name)()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model hook '{name}' returned {type(model).__name__}, not an nn.Module")
    return model


def build_loss(name: str, dataset: str, sample_target: torch.Tensor) -> LossFn:
    """`auto` follows the dataset: regression for synthetic, classification for digits, and for a
    user dataset by the target's dtype (integers mean class labels)."""
    if name == "mse":
        return F.mse_loss
    if name == "cross-entropy":
        return F.cross_entropy
    if name == "auto":
        if dataset == "synthetic":
            return F.mse_loss
        if dataset == "digits" or not sample_target.is_floating_point():
            return F.cross_entropy
        return F.mse_loss
    return cast(LossFn, load_hook(name))
