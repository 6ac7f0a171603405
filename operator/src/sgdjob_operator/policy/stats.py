"""Robust statistics over plain lists (the policy stays dependency-free and exact)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

# Scales the MAD into a consistent estimator of the standard deviation for normal data.
MAD_SCALE = 1.4826
# Windows a running estimate remembers (a speed's, `policy.speeds`; a configuration's progress,
# `policy.progress`): each summed window weighs (1 - 1/MEMORY_WINDOWS) less than the one after it.
MEMORY_WINDOWS = 10


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def mad(values: Sequence[float], center: float | None = None) -> float:
    """Scaled median absolute deviation."""
    c = median(values) if center is None else center
    return MAD_SCALE * median([abs(v - c) for v in values])


def log_spread(values: Sequence[float]) -> float:
    """max/min of positive values as a ratio (1.0 for one value or none)."""
    positive = [v for v in values if v > 0]
    if len(positive) < 2:
        return 1.0
    return max(positive) / min(positive)


def robust_scores(speeds: Mapping[int, float]) -> dict[int, float]:
    """How many robust standard deviations each rank is slower than the median, in log speed.

    Log space makes 2x slower and 2x faster equally far; a floor on the MAD keeps a perfectly
    uniform fleet from turning a rounding difference into a huge score.
    """
    logs = {r: math.log(v) for r, v in speeds.items() if v > 0}
    if not logs:
        return {}
    center = median(list(logs.values()))
    spread = max(mad(list(logs.values()), center), 0.01)
    return {r: (center - x) / spread for r, x in logs.items()}


def gap_clusters(speeds: Mapping[int, float], gap_ratio: float) -> list[list[int]]:
    """Ranks sorted by speed (fastest first), cut wherever the next is `gap_ratio` times slower."""
    order = sorted((r for r in speeds if speeds[r] > 0), key=lambda r: (-speeds[r], r))
    if not order:
        return []
    clusters: list[list[int]] = [[order[0]]]
    for prev, rank in itertools.pairwise(order):
        if speeds[prev] > speeds[rank] * gap_ratio:
            clusters.append([])
        clusters[-1].append(rank)
    return clusters
