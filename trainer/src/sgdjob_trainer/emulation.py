"""Emulated accelerator compute: how long this rank sleeps per step (explicit config, off by default).

The sleep stands for the time a real accelerator would spend on the step, so a 2-core CPU machine
can reproduce unequal workers. Real gradients are still computed and exchanged; only the duration
is emulated. The sleep counts as compute time in every metric.

A step's time is shaped like a real one's: a fixed part plus a part per sample, both multiplied by
the rank's slowdown (its spells, by step or by time, and its bursts), times independent jitter. The
timing rules are pure functions below; `ComputeEmulator` holds the rank's state and sleeps.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from sgdjob_trainer.config import Bursts, Emulation, SpeedChange


def step_seconds(fixed_s: float, per_batch_s: float, batch: int, reference_batch: int, factor: float) -> float:
    """(fixed + per-sample x batch) x factor, the per-sample part given for `reference_batch` samples."""
    return (fixed_s + per_batch_s * batch / reference_batch) * factor


def in_spell(change: SpeedChange, step: int, elapsed_s: float) -> bool:
    """Whether a slowdown's range (in steps, or in seconds since training began) covers this step."""
    if change.by_time:
        start = change.start_seconds or 0.0
        return start <= elapsed_s and (change.end_seconds is None or elapsed_s < change.end_seconds)
    return change.start_step <= step and (change.end_step is None or step < change.end_step)


def spell_factor(changes: Sequence[SpeedChange], rank: int, node: str, step: int, elapsed_s: float) -> float:
    """Product of every slowdown that targets this rank (or its node) now."""
    result = 1.0
    for change in changes:
        targeted = change.rank == rank if change.rank is not None else change.node == node
        if targeted and in_spell(change, step, elapsed_s):
            result *= change.factor
    return result


def in_burst(bursts: Bursts, seed: int, rank: int, step: int) -> bool:
    """Whether `step` falls in a burst of this rank: its block of `bursts.steps` steps is drawn as one,
    from (seed, rank, block) alone, so the answer does not depend on what ran before (a resume)."""
    block = step // bursts.steps
    return random.Random(f"sgdjob-burst:{seed}:{rank}:{block}").random() < bursts.probability


class ComputeEmulator:
    """(fixedSeconds + computeSeconds x batch / reference batch) x slowdowns x bursts x (1 +- jitter)."""

    def __init__(self, emulation: Emulation | None, rank: int, node: str, reference_batch: int, seed: int) -> None:
        self.emulation = emulation
        self.rank = rank
        self.node = node
        self.reference_batch = reference_batch
        self.seed = seed
        self.started = time.monotonic()  # spells in seconds count from here
        # Per-rank stream so the jitter differs between ranks but replays the same on a rerun.
        self.rng = random.Random(seed * 65_537 + rank)

    def factor(self, step: int, elapsed_s: float | None = None) -> float:
        """Every slowdown of this rank at `step` (its spells and bursts); elapsed_s defaults to now."""
        if self.emulation is None:
            return 1.0
        elapsed = time.monotonic() - self.started if elapsed_s is None else elapsed_s
        result = spell_factor(self.emulation.slowdowns, self.rank, self.node, step, elapsed)
        bursts = self.emulation.bursts
        if bursts is not None and in_burst(bursts, self.seed, self.rank, step):
            result *= bursts.factor
        return result

    def seconds(self, step: int, batch_size: int, elapsed_s: float | None = None) -> float:
        emulation = self.emulation
        if emulation is None or (emulation.compute_seconds == 0.0 and emulation.fixed_seconds == 0.0):
            return 0.0
        jitter = emulation.jitter
        noise = 1.0 + self.rng.uniform(-jitter, jitter) if jitter > 0 else 1.0
        factor = self.factor(step, elapsed_s)
        fixed, per_batch = emulation.fixed_seconds, emulation.compute_seconds
        return step_seconds(fixed, per_batch, batch_size, self.reference_batch, factor) * noise

    def run(self, step: int, batch_size: int) -> float:
        """Sleep for this step's emulated compute; returns the seconds slept."""
        seconds = self.seconds(step, batch_size)
        if seconds > 0:
            time.sleep(seconds)
        return seconds
