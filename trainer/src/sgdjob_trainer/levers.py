"""Efficiency levers: learning-rate warmup and schedule, mixed precision with loss scaling.

Learning rate at a step = each group's base rate x the world-size rule (optim.py) x `lr_factor(step)`:
linear warmup from 0 over `warmupSteps`, then constant, cosine down to `minFactor` at the job's
last step, or x `gamma` every `stepSize` steps. The same function runs on the parameter-server
shards (by the pushing worker's step), so async follows the same schedule as sync.

Mixed precision: forward and loss under `torch.autocast` in bf16 or fp16; parameters, gradients
and optimizer state stay fp32. fp16 needs loss scaling, or small gradients underflow to zero:
`LossScaler` is a dynamic scaler with the semantics of torch.amp.GradScaler (start 2^16, halve on
an inf/NaN gradient and skip that step, double after 2000 clean steps). It works on the flat
gradient every strategy builds anyway, so one code path serves all three modes, and its state is
two numbers a checkpoint carries. The finite check runs after the gradient exchange in sync and
hierarchical mode, where every rank (of a group) holds the same averaged gradient, so all ranks
skip or take the same steps; in async each worker checks its own gradient before pushing it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from sgdjob_trainer.config import LrPolicy, LrSchedule, Precision

GROWTH_INTERVAL = 2000
INIT_SCALE = 2.0**16


def lr_factor(policy: LrPolicy, step: int, total_steps: int) -> float:
    """Multiplier of the learning rate for the update made at `step` (0-based)."""
    if step < policy.warmup_steps:
        return (step + 1) / policy.warmup_steps
    if policy.schedule == LrSchedule.COSINE:
        span = max(1, total_steps - policy.warmup_steps)
        progress = min(1.0, (step - policy.warmup_steps) / span)
        return policy.min_factor + (1.0 - policy.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if policy.schedule == LrSchedule.STEP:
        return float(policy.gamma ** ((step - policy.warmup_steps) // policy.step_size))
    return 1.0


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == Precision.FP32:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == Precision.BF16 else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling for fp16; a pass-through (scale 1, never skips) otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.scale = INIT_SCALE if enabled else 1.0
        self.clean_steps = 0
        self.skipped = 0

    def unscale(self, flat: torch.Tensor) -> bool:
        """Divide the (exchanged) flat gradient by the scale in place; False when it holds an inf or
        NaN: the caller skips the update and the scale halves."""
        if not self.enabled:
            return True
        flat.div_(self.scale)
        finite = bool(torch.isfinite(flat).all())
        if finite:
            self.clean_steps += 1
            if self.clean_steps >= GROWTH_INTERVAL:
                self.scale *= 2.0
                self.clean_steps = 0
        else:
            self.scale /= 2.0
            self.clean_steps = 0
            self.skipped += 1
        return finite

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, doc: dict[str, Any]) -> None:
        if self.enabled and doc:
            self.scale = float(doc["scale"])
            self.clean_steps = int(doc["clean_steps"])
            self.skipped = int(doc["skipped"])
