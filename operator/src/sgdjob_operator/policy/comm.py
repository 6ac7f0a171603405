"""Alpha-beta communication cost: what one exchange of the model costs, by pattern.

alpha is the per-message latency, beta the seconds per byte of one link. The policy's cost model
and the simulator both use these formulas, so the simulator's network is the one the policy
assumes; what the policy does not know (speeds, noise, failures) it has to measure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CommModel:
    """Network and model size as the cost model sees them.

    `gradient_bytes` 0 means unknown: exchanges then cost their latency only, and whatever the
    workers wait beyond that is attributed to compute jitter (see `health.jitter_coefficient`).
    `ps_apply_seconds` is a parameter-server shard's fixed work per push (one thread per shard
    serialises pushes, so it caps the pushes per second the whole job can make).
    """

    latency_s: float = 2e-5
    bandwidth_bytes_per_s: float = 1.25e10
    gradient_bytes: int = 0
    ps_apply_seconds: float = 5e-4

    def with_gradient_bytes(self, nbytes: int) -> CommModel:
        return CommModel(self.latency_s, self.bandwidth_bytes_per_s, nbytes, self.ps_apply_seconds)

    @property
    def transfer_s(self) -> float:
        """Seconds to move the whole gradient once over one link (M * beta)."""
        return self.gradient_bytes / self.bandwidth_bytes_per_s

    def allreduce_s(self, n: int) -> float:
        """Bandwidth-optimal ring for the bytes, tree latency (as NCCL/gloo pick per size)."""
        if n <= 1:
            return 0.0
        return 2.0 * math.ceil(math.log2(n)) * self.latency_s + 2.0 * (n - 1) / n * self.transfer_s

    def ps_worker_s(self) -> float:
        """One worker's push of its gradient and pull of fresh parameters through its own link."""
        return 2.0 * self.latency_s + 2.0 * self.transfer_s

    def ps_push_s(self, shards: int) -> float:
        """A shard's busy time per push: its slice in and out plus its fixed apply work (latency
        overlaps across concurrent pushes; bytes and work do not). Every push visits every shard,
        so the apply work bounds the job's pushes per second whatever the shard count."""
        return 2.0 * self.transfer_s / max(1, shards) + self.ps_apply_seconds

    def ps_capacity(self, shards: int) -> float:
        """Most pushes per second the parameter servers absorb (inf when a push costs nothing)."""
        push = self.ps_push_s(shards)
        return 1.0 / push if push > 0 else math.inf
