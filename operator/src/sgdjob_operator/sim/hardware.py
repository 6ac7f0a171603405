"""The simulated hardware: each worker's speed at any time, vectorised over workers."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sgdjob_operator.sim.scenario import Death, Drift, Hiccups, Scenario, Slowdown

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

_STEP, _DRIFT, _DEATH = 0, 1, 2


class SimulatedFleet:
    """Workers (GPUs) on nodes, `nproc_per_node` consecutive workers per node. Events belong to a
    physical node: a worker moved to a replacement node leaves its old node's events behind."""

    def __init__(self, sc: Scenario) -> None:
        self.nproc = sc.nproc_per_node
        nominal: list[float] = []
        caps: list[int] = []
        names: list[str] = []
        for gpu in sc.fleet:
            for _ in range(gpu.nodes):
                names.append(f"{gpu.name.lower()}-{len(names)}")
                nominal += [gpu.speed] * self.nproc
                caps += [gpu.max_batch or 0] * self.nproc
        self.node_names = names
        self.nominal: Floats = np.array(nominal, dtype=np.float64)
        self.caps = caps
        self.size = len(nominal)
        self.node_of: Ints = np.arange(self.size, dtype=np.int64) // self.nproc
        rng = np.random.default_rng(sc.seed)
        rows: list[tuple[int, int, float, float, float]] = []  # node, kind, start, end, factor
        for event in sc.events:
            if isinstance(event, Slowdown):
                end = event.until_seconds if event.until_seconds is not None else np.inf
                rows += [(n, _STEP, event.at_seconds, end, event.factor) for n in event.nodes]
            elif isinstance(event, Drift):
                rows += [(n, _DRIFT, event.start_seconds, event.end_seconds, event.factor) for n in event.nodes]
            elif isinstance(event, Death):
                rows += [(n, _DEATH, event.at_seconds, np.inf, np.inf) for n in event.nodes]
            elif isinstance(event, Hiccups):
                horizon = sc.duration
                lo, hi = event.duration_seconds
                for _ in range(event.count):
                    start = float(rng.uniform(0, horizon))
                    rows.append(
                        (int(rng.integers(self.nodes)), _STEP, start, start + float(rng.uniform(lo, hi)), event.factor)
                    )
        table = np.array(rows, dtype=np.float64).reshape(-1, 5)
        self._ev_node = table[:, 0].astype(np.int64)
        self._ev_kind = table[:, 1].astype(np.int64)
        self._ev_start = table[:, 2]
        self._ev_end = table[:, 3]
        self._ev_factor = table[:, 4]
        self._expand()

    @property
    def nodes(self) -> int:
        return len(self.node_names)

    def _expand(self) -> None:
        """One row per (event, worker) whose worker still sits on the event's node."""
        w_rows: list[int] = []
        e_rows: list[int] = []
        for e, node in enumerate(self._ev_node):
            for w in np.nonzero(self.node_of == node)[0]:
                w_rows.append(int(w))
                e_rows.append(e)
        idx = np.array(e_rows, dtype=np.int64)
        self._w: Ints = np.array(w_rows, dtype=np.int64)
        self._kind: Ints = self._ev_kind[idx]
        self._start: Floats = self._ev_start[idx]
        self._end: Floats = self._ev_end[idx]
        self._factor: Floats = self._ev_factor[idx]
        self._span: Floats = np.maximum(self._end - self._start, 1e-9)

    def replace_node(self, node: int) -> None:
        """The workers of `node` move to a fresh node of the same kind (new name, no events)."""
        workers = np.nonzero(self.node_of == node)[0]
        self.node_names.append(f"{self.node_names[node]}-r")
        self.node_of[workers] = len(self.node_names) - 1
        self._expand()

    def worker_node_name(self, w: int) -> str:
        return self.node_names[int(self.node_of[w])]

    def slowdowns(self, t: float | Floats) -> Floats:
        """Compute-time multiplier of every worker at time `t` (a scalar, or one time per worker);
        inf for a dead worker."""
        slow = np.ones(self.size, dtype=np.float64)
        if self._w.size == 0:
            return slow
        te = np.full(self._w.size, t) if np.isscalar(t) else np.asarray(t)[self._w]
        started = te >= self._start
        mult = np.ones(self._w.size, dtype=np.float64)
        step = (self._kind == _STEP) & started & (te < self._end)
        mult[step] = self._factor[step]
        drift = (self._kind == _DRIFT) & started
        frac = np.clip((te[drift] - self._start[drift]) / self._span[drift], 0.0, 1.0)
        mult[drift] = 1.0 + (self._factor[drift] - 1.0) * frac
        mult[(self._kind == _DEATH) & started] = np.inf
        np.multiply.at(slow, self._w, mult)
        return slow

    def speeds(self, t: float | Floats) -> Floats:
        """Samples per second of every worker at `t` when it never waits (0 when dead)."""
        if self._w.size == 0:
            return self.nominal
        out: Floats = np.divide(self.nominal, self.slowdowns(t))
        return out

    def deaths(self) -> list[tuple[float, int]]:
        """(time, node) of each node death, in time order."""
        pairs = {
            (float(s), int(n))
            for s, n, k in zip(self._ev_start, self._ev_node, self._ev_kind, strict=True)
            if k == _DEATH
        }
        return sorted(pairs)

    def bound(self, duration: float, points: int = 2000) -> float:
        """Time-averaged sum of every worker's speed: the most any mode could process per second."""
        times = (np.arange(points) + 0.5) * duration / points
        return float(np.mean([self.speeds(float(t)).sum() for t in times]))

    def persistent_onset(self, threshold: float) -> float | None:
        """When a lasting difference between workers begins: 0 for a mixed fleet, else the first
        slowdown or drift reaching `threshold`. Hiccups and deaths are not differences to adapt to."""
        if len(set(self.nominal.tolist())) > 1:
            return 0.0
        onsets: list[float] = []
        for kind, start, end, factor in zip(self._ev_kind, self._ev_start, self._ev_end, self._ev_factor, strict=True):
            if kind == _STEP and end == np.inf and factor >= threshold:
                onsets.append(float(start))
            elif kind == _DRIFT and factor >= threshold:
                onsets.append(float(start + (threshold - 1.0) / (factor - 1.0) * (end - start)))
        return min(onsets) if onsets else None
