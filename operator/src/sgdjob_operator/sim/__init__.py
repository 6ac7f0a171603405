"""Discrete-event simulator of an SGDJob's workers, for evaluating the policy at 8..1024 workers."""

from sgdjob_operator.sim.compare import ScenarioResult, simulate_scenario
from sgdjob_operator.sim.scenario import Scenario, ScenarioError, load_scenario
from sgdjob_operator.sim.simulation import SYSTEMS, ModeResult, run_mode

__all__ = [
    "SYSTEMS",
    "ModeResult",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "load_scenario",
    "run_mode",
    "simulate_scenario",
]
