"""Concrete configurations the policy can propose: per-rank batch sizes and hierarchical groups."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sgdjob_operator.policy.stats import gap_clusters

# Ranks whose step at the job's batch is within this fraction of the fastest one's keep the job's batch
# in a trimmed split: a speed measured over a few steps is known to a few per cent, and a sample taken
# off within that noise would chase it.
TRIM_TOLERANCE = 0.03


def proportional_batches(
    weights: Mapping[int, float],
    total: int,
    caps: Mapping[int, int],
    fixed: Mapping[int, float] | None = None,
) -> dict[int, int]:
    """Integer batch sizes proportional to `weights`, summing to `total` (so the global batch, and
    with it the optimisation, stays what the user configured), each at least 1 and at most its cap.
    A rank whose share exceeds its cap gets the cap and the rest is shared again (water-filling).
    With weights read as speeds, a rank's step takes batch / weight and sync waits for the slowest:
    so rounding hands each leftover sample to the rank whose step it lengthens least, which keeps
    the slowest step as short as whole samples allow (the largest fractional part would give a 3x
    straggler 14 of 128 samples where 13 is right, a 7 % longer step for everyone).
    With `fixed` (seconds per step that do not grow with the batch, by rank; weights then are the
    rates of the part that does) the shares equalise fixed + batch / weight instead."""
    w = {r: max(v, 0.0) for r, v in weights.items()}
    f = {r: max((fixed or {}).get(r, 0.0), 0.0) for r in w}
    if not w:
        return {}
    remaining = max(total, len(w))
    out: dict[int, int] = {}
    free = sorted(w)
    while free:
        wsum = sum(w[r] for r in free)
        if wsum > 0:
            # Every free rank's step takes the same time L: f_r + b_r / w_r = L with sum b_r = remaining,
            # so b_r = remaining w_r / W + w_r (sum w f / W - f_r) (the proportional share plus a
            # fixed-part correction; written so as not to divide by a tiny W twice).
            mean_fixed = sum(w[r] / wsum * f[r] for r in free)
            shares = {r: remaining * (w[r] / wsum) + w[r] * (mean_fixed - f[r]) for r in free}
        else:
            shares = {r: remaining / len(free) for r in free}
        over = [r for r in free if shares[r] > caps[r]]
        if not over:
            alloc = {r: min(caps[r], max(1, math.floor(x))) for r, x in shares.items()}
            leftover = remaining - sum(alloc.values())
            # The floor of one sample per rank can overshoot: take it back from the largest.
            for r in sorted(free, key=lambda r: (-alloc[r], r)):
                if leftover >= 0:
                    break
                give = min(alloc[r] - 1, -leftover)
                alloc[r] -= give
                leftover += give
            while leftover > 0:
                room = [r for r in free if alloc[r] < caps[r]]
                if not room:
                    break
                r = min(
                    room,
                    key=lambda r: (_step(alloc[r] + 1, w[r], f[r]), -(shares[r] - math.floor(shares[r])), r),
                )
                alloc[r] += 1
                leftover -= 1
            out.update(alloc)
            break
        for r in over:
            out[r] = caps[r]
            remaining -= caps[r]
        taken = set(over)
        free = [r for r in free if r not in taken]
    # A rank capped early can leave the rest less than a sample each (zero-weight ranks still get one):
    # the largest batches give back the overshoot.
    excess = sum(out.values()) - max(total, len(w))
    for r in sorted(out, key=lambda r: (-out[r], r)):
        if excess <= 0:
            break
        give = min(out[r] - 1, excess)
        out[r] -= give
        excess -= give
    return out


def _step(batch: int, weight: float, fixed: float = 0.0) -> float:
    return fixed + batch / weight if weight > 0 else math.inf


def rebalanced_batches(
    speeds: Mapping[int, float], total: int, caps: Mapping[int, int], fixed: Mapping[int, float] | None = None
) -> dict[int, int]:
    """Batch sizes that give every rank the same time per step: proportional to speed, or, with
    `fixed` seconds per step (speeds then are the rates of the part that grows with the batch),
    equal fixed + batch / speed."""
    return proportional_batches(speeds, total, caps, fixed)


def trimmed_batches(
    rates: Mapping[int, float], base: int, caps: Mapping[int, int], fixed: Mapping[int, float] | None = None
) -> dict[int, int]:
    """Sync's split that keeps the step the fastest ranks take for the job's batch `base`: those within
    TRIM_TOLERANCE of the fastest keep `base`, and every other rank gets the whole samples it finishes
    in their step (fixed + batch / rate), at least 1 and at most `base` and its cap. The global batch
    shrinks by what the slow ranks cannot finish, instead of the fast ranks taking it over
    (`rebalanced_batches`)."""
    f = {r: max((fixed or {}).get(r, 0.0), 0.0) for r in rates}
    times = {r: _step(base, v, f[r]) for r, v in rates.items() if v > 0}
    if not times:
        return {r: base for r in rates}
    fastest = min(times.values())
    kept = {r for r, t in times.items() if t <= fastest * (1 + TRIM_TOLERANCE)}
    step = max(times[r] for r in kept)
    out: dict[int, int] = {}
    for r, v in rates.items():
        # A hair of tolerance: a share that is exactly whole is not one sample less by rounding.
        fits = base if r in kept else math.floor((step - f[r]) * v * (1 + 1e-9)) if v > 0 else 1
        out[r] = max(1, min(base, caps.get(r, base), fits))
    return out


def group_size_target(world: int) -> int:
    """About sqrt(world) ranks per group: few enough groups that the cross-group average stays
    cheap, small enough groups that one slow member stalls only its own group."""
    return max(2, round(math.sqrt(world)))


def speed_groups(speeds: Mapping[int, float], gap_ratio: float, target_size: int) -> list[list[int]]:
    """Hierarchical groups: speed clusters (cut where the next rank is `gap_ratio` times slower),
    each cut into near-equal chunks of about `target_size` ranks of neighbouring speed."""
    groups: list[list[int]] = []
    for cluster in gap_clusters(speeds, gap_ratio):
        k = max(1, math.ceil(len(cluster) / target_size))
        size, extra = divmod(len(cluster), k)
        start = 0
        for i in range(k):
            end = start + size + (1 if i < extra else 0)
            groups.append(sorted(cluster[start:end]))
            start = end
    return groups


def node_groups(nodes: Mapping[int, str | None]) -> list[list[int]]:
    """One group per node (ranks with no node known form their own group), as the trainer's
    default groupBy: node does."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(nodes.items()):
        by_node.setdefault(node if node is not None else f"rank-{rank}", []).append(rank)
    return sorted(by_node.values())


def paced_group_batches(
    speeds: Mapping[int, float], groups: Sequence[Sequence[int]], total: int, caps: Mapping[int, int]
) -> dict[int, int]:
    """Batch sizes for hierarchical groups that keep pace with each other: a group steps at its
    slowest member's pace, so every member of a group gets a batch proportional to that speed.
    (The trainer bounds how far a group may run ahead, so unpaced groups end up at the slowest
    group's pace whatever their own speed.)"""
    weights: dict[int, float] = {}
    for group in groups:
        slowest = min(speeds[r] for r in group)
        for r in group:
            weights[r] = slowest
    return proportional_batches(weights, total, caps)
