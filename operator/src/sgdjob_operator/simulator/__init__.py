"""Discrete-event simulator of an SGDJob's workers, for evaluating the policy at 8..1024 workers."""

from sgdjob_operator.simulator.report import ScenarioResult, simulate_scenario
from sgdjob_operator.simulator.runner import MODES, ModeResult, run_mode
from sgdjob_operator.simulator.scenario import Scenario, ScenarioError, load_scenario

__all__ = ["MODES", "ModeResult", "Scenario", "ScenarioError", "ScenarioResult", "load_scenario", "run_mode", "simulate_scenario"]
