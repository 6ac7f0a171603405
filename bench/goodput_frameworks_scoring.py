"""The framework goodput benchmark's scoring (pure): a run's validation file as a curve, its time to
the target validation loss and its loss at the budget, the spread over seeds, the ratio of SGDJob's
auto to plain torchrun, and the markdown table. The runs themselves are bench.goodput_frameworks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.goodput_scoring import SUSTAIN, fmt_number, spread, spread_cell

PLAIN = "torchrun"  # the user's baseline: the same script under plain torchrun, equal batches
AUTO = "sgdjob-auto"  # the same script as an SGDJob, mode auto, on the adaptation API
ASYNC = "sgdjob-async"  # the same SGDJob in mode async throughout (scripts whose optimizer allows it)
SYSTEMS = (PLAIN, AUTO, ASYNC)

DEFINITIONS = {
    "time_to_target_s": (
        f"seconds since rank 0's training began until the first validation (rank 0, held-out samples no rank "
        f"trains on) at which the mean loss of it and the {SUSTAIN - 1} validations before it is at or below "
        f"the target; None when that never happened (counted as infinitely late over seeds)"
    ),
    "step_at_target": (
        "the optimizer step of that validation; both systems read the same samples a step (a rebalance "
        "re-cuts the same global batch), so equal steps mean the time difference is speed alone"
    ),
    "loss_at_budget": f"mean validation loss of the last {SUSTAIN} validations at or before the budget",
    "last_step_s": "seconds since training began at the run's last validation (its last step)",
    "harness_s": "wall time of the whole command, start-up and shut-down included",
    "ratio": (
        f"{AUTO} / {PLAIN} time to target ({ASYNC} / {PLAIN} in ratio_async): the ratio of the medians, and "
        "each seed's own ratio (same seed, same model initialisation and data order)"
    ),
    "aggregate": "median [min-max] over seeds",
}

Points = list[tuple[float, int, float]]  # (seconds since training began, step, validation loss)


def parse_validation(text: str) -> Points:
    """The script's validation.jsonl (one JSON object a line: time_s, step, loss) as points in time
    order; lines that are not complete records (a run killed mid-write) are skipped."""
    points: Points = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            continue
        t, step, loss = row.get("time_s"), row.get("step"), row.get("loss")
        if not (isinstance(t, int | float) and isinstance(step, int) and isinstance(loss, int | float)):
            continue
        if math.isfinite(t) and math.isfinite(loss):
            points.append((float(t), step, float(loss)))
    return sorted(points)


def time_to_loss(points: Points, target: float, sustain: int = SUSTAIN) -> tuple[float, int] | None:
    """(time, step) of the first validation at which the mean loss of it and the `sustain` - 1 before
    it is at or below `target`; None when it never is."""
    for i in range(sustain - 1, len(points)):
        window = points[i - sustain + 1 : i + 1]
        if sum(loss for _, _, loss in window) / sustain <= target:
            return points[i][0], points[i][1]
    return None


def loss_at(points: Points, budget_s: float, sustain: int = SUSTAIN) -> float | None:
    """Mean loss of the last `sustain` validations at or before `budget_s` (fewer when fewer had run);
    None when none had."""
    before = [loss for t, _, loss in points if t <= budget_s][-sustain:]
    return sum(before) / len(before) if before else None


def run_figures(points: Points, target: float, budget_s: float) -> dict[str, Any]:
    """One run's figures from its validation curve (DEFINITIONS)."""
    reached = time_to_loss(points, target)
    return {
        "time_to_target_s": reached[0] if reached is not None else None,
        "step_at_target": reached[1] if reached is not None else None,
        "loss_at_budget": loss_at(points, budget_s),
        "last_step_s": points[-1][0] if points else None,
        "last_step": points[-1][1] if points else None,
        "final_loss": points[-1][2] if points else None,
    }


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system's figures over seeds: median, min and max of each."""
    return {
        "time_to_target_s": spread([r["time_to_target_s"] for r in runs], math.inf),
        "loss_at_budget": spread([r["loss_at_budget"] for r in runs], math.inf),
        "last_step_s": spread([r["last_step_s"] for r in runs], math.inf),
        "harness_s": spread([r["harness_s"] for r in runs], math.inf),
        "reached": sum(r["time_to_target_s"] is not None for r in runs),
        "seeds": len(runs),
        "ok": all(r["ok"] for r in runs),
        "runs": list(runs),
    }


def ratio(systems: Mapping[str, Mapping[str, Any]], of: str = AUTO) -> dict[str, Any]:
    """`of` / plain time to target: of the medians, and per seed (None where either missed it)."""
    plain, auto = systems.get(PLAIN), systems.get(of)
    if plain is None or auto is None:
        return {"of_medians": None, "per_seed": []}
    p, a = plain["time_to_target_s"]["median"], auto["time_to_target_s"]["median"]
    by_seed = {r["seed"]: r["time_to_target_s"] for r in plain["runs"]}
    per_seed = []
    for run in auto["runs"]:
        base = by_seed.get(run["seed"])
        mine = run["time_to_target_s"]
        per_seed.append(mine / base if mine is not None and base else None)
    return {"of_medians": a / p if a is not None and p else None, "per_seed": per_seed}


def what_auto_did(runs: Sequence[Mapping[str, Any]]) -> str:
    """Each seed's rebalances (step) and last per-rank batches, or what went wrong."""
    parts = []
    for run in runs:
        if run.get("error"):
            parts.append(f"seed {run['seed']}: ERROR {run['error']}")
            continue
        steps = [str(d.get("step")) for d in run.get("decisions") or [] if d.get("action") == "rebalance"]
        batches = run.get("final_batches") or []
        did = f"rebalance@{', '.join(steps)}" if steps else "no rebalance"
        parts.append(f"{did}, batches {'/'.join(map(str, batches))} at the end" if batches else did)
    return "; ".join(parts)


def markdown_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per framework and system, median [min-max] over seeds, and the ratio per framework."""
    lines = [
        f"| framework | system | time to target (s, mean of {SUSTAIN}) | reached | step at target "
        "| loss at budget | time to last step (s) | whole run (s) | what SGDJob did |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for system in SYSTEMS:
            s = r["systems"].get(system)
            if s is None:
                continue
            steps = sorted({run["step_at_target"] for run in s["runs"] if run["step_at_target"] is not None})
            errors = [f"seed {run['seed']}: {run['error']}" for run in s["runs"] if run.get("error")]
            if system == AUTO:
                did = what_auto_did(s["runs"])
            else:
                did = "ERROR " + errors[0] if errors else "equal batches" if system == PLAIN else "async throughout"
            lines.append(
                f"| {r['framework']} | {system} | {spread_cell(s['time_to_target_s'], '.1f', 'not reached')} "
                f"| {s['reached']}/{s['seeds']} | {', '.join(map(str, steps)) or '—'} "
                f"| {spread_cell(s['loss_at_budget'], '.3f')} | {spread_cell(s['last_step_s'], '.1f')} "
                f"| {spread_cell(s['harness_s'], '.0f')} | {did} |"
            )
    lines += [
        "",
        f"| framework | target loss | budget (s) | system | time to target / {PLAIN}'s | per seed |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in results:
        for system, key in ((AUTO, "ratio"), (ASYNC, "ratio_async")):
            q = r.get(key)
            if q is None or system not in r["systems"]:
                continue
            seeds = ", ".join(fmt_number(x, ".2f") for x in q["per_seed"]) or "—"
            lines.append(
                f"| {r['framework']} | {r['target_loss']:g} | {r['budget_s']:g} | {system} "
                f"| {fmt_number(q['of_medians'], '.2f')}x | {seeds} |"
            )
    return "\n".join(lines) + "\n"
