"""Discrete-event models of the three modes. No sleeping, no processes: time is a number.

Each engine advances to a time, committing the steps that end by then into per-worker counters
(the same cumulative counters a trainer exports), and can finish its in-flight steps (`barrier`)
when the job changes mode. A dead worker's compute time is infinite, so whatever waits for it
stalls, as the real job would until its failure is detected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sgdjob_operator.policy.comm import CommModel
from sgdjob_operator.sim.hardware import Floats, Ints, SimulatedFleet
from sgdjob_operator.sim.loss import statistical_efficiency


class Counters:
    """Per-worker cumulative counters, reset when the processes restart; job-wide useful work
    (samples weighted by statistical efficiency) and processed samples survive restarts."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.useful = 0.0
        self.processed = 0.0
        self.reset()

    def reset(self) -> None:
        n = self.size
        self.steps: Ints = np.zeros(n, dtype=np.int64)
        self.samples: Ints = np.zeros(n, dtype=np.int64)
        self.compute: Floats = np.zeros(n)
        self.wait: Floats = np.zeros(n)
        self.stale_sum: Floats = np.zeros(n)
        self.stale_n: Floats = np.zeros(n)

    def take_staleness(self) -> Floats:
        """Mean staleness per worker since the last call (the trainer's gauge), then start over."""
        out: Floats = np.divide(self.stale_sum, self.stale_n, out=np.zeros(self.size), where=self.stale_n > 0)
        self.stale_sum[:] = 0.0
        self.stale_n[:] = 0.0
        return out


# Noise is drawn this many values at a time: one draw per step would cost more than the step.
NOISE_BLOCK = 1 << 16


@dataclass
class Env:
    fleet: SimulatedFleet
    counters: Counters
    rng: np.random.Generator
    comm: CommModel
    noise: float
    penalty: float

    def __post_init__(self) -> None:
        self._buf: Floats = np.empty(0)
        self._pos = 0

    def _jitter(self, n: int) -> Floats:
        if self._pos + n > self._buf.size:
            size = max(NOISE_BLOCK, n)
            self._buf = self.rng.lognormal(-0.5 * self.noise**2, self.noise, size)
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def compute(self, workers: Ints, batches: Floats, t: float | Floats, steps: int = 1) -> Floats:
        """Compute seconds of `steps` consecutive steps (rows) of `workers` starting at `t`, with
        mean-1 lognormal noise; one row is returned flat."""
        speeds = self.fleet.speeds(t)[workers]
        if speeds.min() > 0:
            out: Floats = batches / speeds
        else:
            # A dead worker (speed 0) takes forever: inf, not a warning.
            out = np.divide(batches, speeds, out=np.full(workers.size, np.inf), where=speeds > 0)
        noise = (
            self._jitter(workers.size * steps).reshape(steps, workers.size)
            if self.noise > 0
            else np.ones((steps, workers.size))
        )
        rows: Floats = out * noise
        return rows[0] if steps == 1 else rows


class SyncEngine:
    """Every member computes, then one allreduce; the step ends when the slowest is done.
    Steps accumulate here and reach the shared counters on `flush` (every member steps together,
    so per-step bookkeeping is one vector add)."""

    def __init__(self, env: Env, members: Ints, batches: Floats, t0: float) -> None:
        self.env, self.m, self.b, self.t = env, members, batches[members], t0
        self.b_sum = float(self.b.sum())
        self.allreduce = env.comm.allreduce_s(members.size)
        self._c: Floats | None = None
        self._wall = 0.0
        self._steps = 0
        self._acc_c: Floats = np.zeros(members.size)
        self._acc_wall = 0.0

    def advance(self, until: float) -> None:
        while True:
            if self._c is None:
                self._c = self.env.compute(self.m, self.b, self.t)
                self._wall = float(self._c.max()) + self.allreduce
            if self.t + self._wall > until:
                return
            self._commit()

    def _commit(self) -> None:
        assert self._c is not None
        self._acc_c += self._c
        self._acc_wall += self._wall
        self._steps += 1
        self.env.counters.useful += self.b_sum
        self.env.counters.processed += self.b_sum
        self.t += self._wall
        self._c = None

    def flush(self) -> None:
        if self._steps:
            k, m = self.env.counters, self.m
            k.steps[m] += self._steps
            k.samples[m] += (self.b * self._steps).astype(np.int64)
            k.compute[m] += self._acc_c
            k.wait[m] += self._acc_wall - self._acc_c
            self._steps, self._acc_wall = 0, 0.0
            self._acc_c[:] = 0.0

    def barrier(self) -> float:
        if self._c is not None and np.isfinite(self._wall):
            self._commit()
        self.flush()
        return self.t


class AsyncEngine:
    """Workers push to sharded parameter servers at their own pace. A gradient's staleness is the
    updates others made during its step per other worker (as the trainer counts it); one staler
    than the bound is dropped. Pushes beyond the shards' capacity slow every worker alike."""

    def __init__(self, env: Env, members: Ints, batches: Floats, t0: float, bound: int | None, shards: int) -> None:
        self.env, self.m, self.b = env, members, batches[members]
        self.bound = bound
        self.push = env.comm.ps_worker_s()
        self.capacity = env.comm.ps_capacity(shards)
        n = members.size
        self.c: Floats = np.zeros(n)
        self.raw: Floats = np.full(n, np.inf)
        self.cycle: Floats = np.zeros(n)
        self.end: Floats = np.zeros(n)
        self.t = t0
        self._draw(np.arange(n), np.full(n, t0))

    def _draw(self, idx: Ints, start: Floats) -> None:
        times = np.zeros(self.env.fleet.size)
        times[self.m[idx]] = start
        self.c[idx] = self.env.compute(self.m[idx], self.b[idx], times)
        self.raw[idx] = self.c[idx] + self.push
        demand = float(np.sum(1.0 / self.raw))
        stretch = max(1.0, demand / self.capacity)
        self.cycle[idx] = self.raw[idx] * stretch
        self.end[idx] = start + self.cycle[idx]

    def advance(self, until: float) -> None:
        while True:
            due = np.nonzero(self.end <= until)[0]
            if due.size == 0:
                return
            self._commit(due)
            self._draw(due, self.end[due])

    def _commit(self, idx: Ints) -> None:
        k, n = self.env.counters, self.m.size
        rates = 1.0 / self.cycle
        total = float(rates.sum())
        stale = (total - rates[idx]) / (rates[idx] * max(1, n - 1))
        applied = np.ones(idx.size, dtype=bool) if self.bound is None else stale <= self.bound
        w, b = self.m[idx], self.b[idx]
        k.steps[w] += 1
        k.samples[w] += np.where(applied, b, 0).astype(np.int64)
        k.compute[w] += self.c[idx]
        k.wait[w] += self.cycle[idx] - self.c[idx]
        k.stale_sum[w] += stale
        k.stale_n[w] += 1
        k.useful += float(np.sum(b * applied * statistical_efficiency(stale, self.env.penalty)))
        k.processed += float(b.sum())
        self.t = max(self.t, float(self.end[idx].max()))

    def flush(self) -> None:
        """Async commits straight into the counters."""

    def barrier(self) -> float:
        live = np.nonzero(np.isfinite(self.end))[0]
        if live.size:
            self._commit(live)
            self.t = max(self.t, float(self.end[live].max()))
        return self.t


@dataclass
class _Round:
    """One averaging round of every group: step end times (steps x groups), cumulative compute per
    step and worker (with a leading zero row), and how many steps of each group are committed."""

    q: int
    starts: Floats
    ends: Floats
    cum_c: Floats
    committed: Ints


class HierarchicalEngine:
    """Sync inside each group; every `every` steps a group starts a world-wide average of its
    model and uses it `staleness` rounds later, so a group runs at most that many rounds ahead of
    the slowest group and then waits (the trainer's bounded-delay model averaging).

    Computed a round at a time for all groups at once (speeds are sampled at each group's round
    start, a fraction of a second), and committed step by step up to the time asked for."""

    def __init__(self, env: Env, groups: list[Ints], batches: Floats, t0: float, every: int, staleness: int) -> None:
        self.env, self.every, self.s = env, every, staleness
        sizes = np.array([g.size for g in groups], dtype=np.int64)
        n = int(sizes.sum())
        self.order: Ints = np.concatenate(groups)
        self.offsets: Ints = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.gid: Ints = np.repeat(np.arange(sizes.size), sizes)
        self.b: Floats = batches[self.order]
        self.b_sum: Floats = np.add.reduceat(self.b, self.offsets)
        self.inner: Floats = np.array([env.comm.allreduce_s(int(g)) for g in sizes])
        self.world = env.comm.allreduce_s(n)
        self.outside: Floats = (n - sizes) / max(1, n - 1)
        self.next_start: Floats = np.full(sizes.size, t0)
        self.done: list[float] = []
        self.rounds: list[_Round] = []
        self.last_end: Floats = np.full(sizes.size, t0)
        self.t = t0
        self._cols = np.arange(n)

    def _compute_round(self) -> None:
        q, h, fleet = len(self.done) + 1, self.every, self.env.fleet
        starts = self.next_start
        times = np.zeros(fleet.size)
        times[self.order] = self.next_start[self.gid]
        c = self.env.compute(self.order, self.b, times, h).reshape(h, -1)
        walls = np.maximum.reduceat(c, self.offsets, axis=1) + self.inner
        ends = self.next_start + np.cumsum(walls, axis=0)
        arrival = ends[-1]
        self.done.append(float(arrival.max()) + self.world)
        need = q - self.s
        self.next_start = np.maximum(arrival, self.done[need - 1]) if need >= 1 else arrival
        cum = np.vstack([np.zeros(c.shape[1]), np.cumsum(c, axis=0)])
        self.rounds.append(_Round(q, starts, ends, cum, np.zeros(ends.shape[1], dtype=np.int64)))

    def advance(self, until: float) -> None:
        while float(self.next_start.min()) <= until:
            self._compute_round()
        self._commit(lambda r: (r.ends <= until).sum(axis=0))

    def _commit(self, steps_done: Callable[[_Round], Ints]) -> None:
        cnt, h = self.env.counters, self.every
        for r in self.rounds:
            j = np.maximum(steps_done(r), r.committed)
            new = j - r.committed
            if not new.any():
                continue
            moved = new > 0
            end = r.ends[np.maximum(j - 1, 0), np.arange(j.size)]
            clock = np.where(moved, end - self.last_end, 0.0)
            self.last_end = np.where(moved, end, self.last_end)
            self.t = max(self.t, float(end[moved].max()))
            jp, cp, moved_p = j[self.gid], r.committed[self.gid], moved[self.gid]
            with np.errstate(invalid="ignore"):
                compute = np.where(moved_p, r.cum_c[jp, self._cols] - r.cum_c[cp, self._cols], 0.0)
            w = self.order
            cnt.steps[w] += new[self.gid]
            cnt.samples[w] += (self.b * new[self.gid]).astype(np.int64)
            cnt.compute[w] += compute
            cnt.wait[w] += np.where(moved_p, clock[self.gid] - compute, 0.0)
            # A step's model age: the rounds still in flight times `every`, plus steps into the round.
            ages = min(r.q - 1, self.s) * h + np.arange(h, dtype=np.float64)
            rows = np.arange(h)[:, None]
            taken = (rows >= r.committed[None, :]) & (rows < j[None, :])
            eff = np.exp(-self.env.penalty * np.outer(ages, self.outside))
            cnt.useful += float(np.sum(taken * eff * self.b_sum))
            cnt.processed += float(np.sum(new * self.b_sum))
            age_sum = (taken * ages[:, None]).sum(axis=0)
            cnt.stale_sum[w] += np.where(moved_p, (age_sum / np.maximum(new, 1))[self.gid], 0.0)
            cnt.stale_n[w] += moved_p
            r.committed = j
        self.rounds = [r for r in self.rounds if (r.committed < h).any()]

    def flush(self) -> None:
        """Commits go straight into the counters."""

    def barrier(self) -> float:
        """Finish every step already started (a group blocked on a round starts none)."""
        now = self.t
        self._commit(lambda r: (np.vstack([r.starts, r.ends[:-1]]) <= now).sum(axis=0))
        return self.t


Engine = SyncEngine | AsyncEngine | HierarchicalEngine
