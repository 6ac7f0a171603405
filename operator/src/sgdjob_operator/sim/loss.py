"""The simulator's loss model: what a stale gradient is worth, and the loss the useful work buys.

The policy's cost model charges staleness linearly (1 - penalty x s); the simulated "truth" decays
exponentially, so the two agree for small staleness and the policy is not graded by its own formula.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

INITIAL_LOSS = 2.3
FLOOR_LOSS = 0.1


def statistical_efficiency(staleness: npt.NDArray[np.float64], penalty: float) -> npt.NDArray[np.float64]:
    """Fraction of a fresh gradient's progress a gradient `staleness` steps old makes (the
    hierarchical engine inlines the same formula for one scalar)."""
    out: npt.NDArray[np.float64] = np.exp(-penalty * np.maximum(staleness, 0.0))
    return out


def loss_after(useful_samples: float, reference_samples: float) -> float:
    """Training loss after `useful_samples` of fresh-gradient-equivalent work; `reference_samples`
    (what the bound would process in the run) sets the scale: the excess loss falls as 1/(1+4x)."""
    x = useful_samples / reference_samples if reference_samples > 0 else 0.0
    return FLOOR_LOSS + (INITIAL_LOSS - FLOOR_LOSS) / (1.0 + 4.0 * x)
