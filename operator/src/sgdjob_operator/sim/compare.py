"""One scenario through every mode, as the JSON document and table `sgdjob simulate` writes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sgdjob_operator.sim.hardware import SimulatedFleet
from sgdjob_operator.sim.scenario import Drift, Scenario, Slowdown
from sgdjob_operator.sim.simulation import SYSTEMS, ModeResult, run_mode


@dataclass
class ScenarioResult:
    scenario: Scenario
    bound: float
    modes: dict[str, ModeResult]
    seconds: float

    @property
    def homogeneous(self) -> bool:
        """Every worker of one speed and no lasting slowdown (noise, hiccups and deaths allowed)."""
        same = len({g.speed for g in self.scenario.fleet}) == 1
        return same and not any(isinstance(e, Slowdown | Drift) for e in self.scenario.events)

    @property
    def best_static(self) -> tuple[str, float]:
        static = {m: r.efficiency for m, r in self.modes.items() if m != "auto"}
        best = max(static, key=lambda m: static[m])
        return best, static[best]

    def to_json(self) -> dict[str, Any]:
        modes: dict[str, Any] = {}
        for m, r in self.modes.items():
            entry: dict[str, Any] = {"efficiency": round(r.efficiency, 4)}
            if m == "auto":
                entry.update(switches=r.switches, detection_delay_s=r.detection_delay_s, decisions=r.decisions)
            modes[m] = entry
        return {
            "name": self.scenario.name,
            "workers": self.scenario.workers,
            "homogeneous": self.homogeneous,
            "bound": round(self.bound, 3),
            "modes": modes,
        }


def simulate_scenario(sc: Scenario, modes: tuple[str, ...] = SYSTEMS) -> ScenarioResult:
    started = time.perf_counter()
    bound = SimulatedFleet(sc).bound(sc.duration)
    results = {m: run_mode(sc, m, bound) for m in modes}
    return ScenarioResult(sc, bound, results, time.perf_counter() - started)


def table(results: list[ScenarioResult]) -> str:
    """Efficiency (useful throughput / bound) per scenario and mode, with auto's distance to the
    best static mode and its changes."""
    head = (
        f"{'scenario':<28} {'workers':>7} "
        + " ".join(f"{m:>12}" for m in SYSTEMS)
        + f" {'best static':>18} {'auto/best':>9} {'changes':>7} {'detect s':>8} {'sim s':>6}"
    )
    lines = [head, "-" * len(head)]
    for res in results:
        best, value = res.best_static
        auto = res.modes.get("auto")
        cells = " ".join(f"{res.modes[m].efficiency:>12.3f}" if m in res.modes else f"{'-':>12}" for m in SYSTEMS)
        ratio = f"{auto.efficiency / value:>9.3f}" if auto and value > 0 else f"{'-':>9}"
        delay = auto.detection_delay_s if auto else None
        lines.append(
            f"{res.scenario.name:<28} {res.scenario.workers:>7} {cells} {best + f' {value:.3f}':>18} {ratio} "
            f"{auto.switches if auto else 0:>7} {delay if delay is not None else '-':>8} {res.seconds:>6.1f}"
        )
    return "\n".join(lines)
