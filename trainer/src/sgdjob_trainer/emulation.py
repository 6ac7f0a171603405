"""Emulated accelerator compute: how long this rank sleeps per step (explicit config, off by default).

The sleep stands for the time a real accelerator would spend on the step, so a 2-core CPU machine
can reproduce unequal workers. Real gradients are still computed and exchanged; only the duration
is emulated. The sleep counts as compute time in every metric.
"""

from __future__ import annotations

import random
import time

from sgdjob_trainer.config import Emulation


class ComputeEmulator:
    """computeSeconds x factor x (batch / reference batch) x (1 +- jitter), per step."""

    def __init__(self, emulation: Emulation | None, rank: int, node: str, reference_batch: int, seed: int) -> None:
        self.emulation = emulation
        self.rank = rank
        self.node = node
        self.reference_batch = reference_batch
        # Per-rank stream so the jitter differs between ranks but replays the same on a rerun.
        self.rng = random.Random(seed * 65_537 + rank)

    def factor(self, step: int) -> float:
        """Product of every slowdown that targets this rank (or its node) at `step`."""
        result = 1.0
        if self.emulation is None:
            return result
        for change in self.emulation.slowdowns:
            targeted = change.rank == self.rank if change.rank is not None else change.node == self.node
            in_range = change.start_step <= step and (change.end_step is None or step < change.end_step)
            if targeted and in_range:
                result *= change.factor
        return result

    def seconds(self, step: int, batch_size: int) -> float:
        if self.emulation is None or self.emulation.compute_seconds == 0.0:
            return 0.0
        jitter = self.emulation.jitter
        noise = 1.0 + self.rng.uniform(-jitter, jitter) if jitter > 0 else 1.0
        return self.emulation.compute_seconds * self.factor(step) * (batch_size / self.reference_batch) * noise

    def run(self, step: int, batch_size: int) -> float:
        """Sleep for this step's emulated compute; returns the seconds slept."""
        seconds = self.seconds(step, batch_size)
        if seconds > 0:
            time.sleep(seconds)
        return seconds
