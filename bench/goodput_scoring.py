"""The goodput benchmark's scoring (pure): each run's time to the target accuracy and accuracy at the
budget from its validation curve, the spread over seeds, and the markdown table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.results import ddp_result, sgdjob_result
from bench.systems import RunRecord

# `auto` runs at the task's policy (the short interval the policy was tuned at, 0.5 s on the digits
# tasks); `auto-default` is the same job at the shipping default policy.intervalSeconds (10 s), so
# every table shows what a user who sets nothing gets beside what the tuning saw.
SYSTEMS = ("ddp", "ddp-drop", "lb-bsp", "sync", "hierarchical", "async", "auto", "auto-default")
AUTO_SYSTEMS = ("auto", "auto-default")
# A model is trained to a quality when its validations hold it, not when one of them lands above it:
# this task's accuracy swings by 10-20 points between neighbouring validations (every 5 steps), so the
# first single validation over the target rewards a noisier trajectory (measured over 10 seeds of a 3x
# straggler: the trimmed split's first single crossing came 4 % sooner than the rebalanced split's, its
# mean of three 6 % later, and its accuracy at the budget was lower; see bench/HISTORY.md). Both figures
# are therefore taken over SUSTAIN consecutive validations; the single-validation ones are kept beside.
SUSTAIN = 3

DEFINITIONS = {
    "time_to_target_s": (
        f"seconds since that run's training start until the first validation of rank 0 (on the held-out split) "
        f"at which the mean accuracy of it and the {SUSTAIN - 1} validations before it is at or above the target; "
        f"None when that never happened"
    ),
    "accuracy_at_budget": (
        f"mean validation accuracy of the last {SUSTAIN} validations at or before the wall-time budget (seconds "
        f"since training start); a run that ended before the budget keeps its final validations"
    ),
    "first_crossing_s": (
        "seconds since training start until the first single validation at or above the target (the definition "
        "before the sustained one); None when none was"
    ),
    "last_accuracy_at_budget": "accuracy of the single last validation at or before the budget",
    "throughput": (
        "applied samples of all ranks / the longest rank's training wall time (start-up excluded); only samples "
        "whose gradients were applied count (ddp-drop: the N-1 workers it runs on)"
    ),
    "aggregate": (
        "median, min and max over seeds; a seed that never reached the target counts as infinitely late "
        "(so the median is null when at least half the seeds did not reach it, and max is null when one did not)"
    ),
}

Points = list[tuple[float, float]]  # (seconds since training start, validation accuracy)


def accuracy_points(rows: Sequence[Mapping[str, Any]] | None) -> Points:
    """report.json's `validation_curve` (or the DDP baseline's `validationCurve`): the rows with an
    accuracy, as (time_s, accuracy), in time order."""
    out: Points = []
    for row in rows or []:
        t, acc = row.get("time_s"), row.get("accuracy")
        if isinstance(t, int | float) and isinstance(acc, int | float) and math.isfinite(t) and math.isfinite(acc):
            out.append((float(t), float(acc)))
    return sorted(out)


def time_to_accuracy(points: Points, target: float, sustain: int = 1) -> float | None:
    """First time the mean accuracy of a validation and the `sustain` - 1 before it is at or above
    `target` (sustain 1: a single validation); None when it never is."""
    for i in range(sustain - 1, len(points)):
        window = points[i - sustain + 1 : i + 1]
        if sum(acc for _, acc in window) / sustain >= target:
            return points[i][0]
    return None


def accuracy_at(points: Points, budget_s: float, sustain: int = 1) -> float | None:
    """The mean accuracy of the last `sustain` validations at or before `budget_s` (fewer when fewer
    had run by then); None when there was none by then."""
    before = [acc for t, acc in points if t <= budget_s][-sustain:]
    return sum(before) / len(before) if before else None


def curve_figures(points: Points, target: float, budget_s: float) -> dict[str, float | None]:
    """A run's quality figures from its validation curve (see DEFINITIONS)."""
    return {
        "time_to_target_s": time_to_accuracy(points, target, SUSTAIN),
        "accuracy_at_budget": accuracy_at(points, budget_s, SUSTAIN),
        "first_crossing_s": time_to_accuracy(points, target),
        "last_accuracy_at_budget": accuracy_at(points, budget_s),
    }


def rescore(results: Sequence[Mapping[str, Any]], target: float, budget_s: float) -> list[dict[str, Any]]:
    """A finished run's results with every run's figures recomputed from its stored curve by the
    current definitions (a goodput.json written before them included), and aggregated again."""
    out: list[dict[str, Any]] = []
    for r in results:
        systems: dict[str, Any] = {}
        for name, s in r["systems"].items():
            runs = [{**run, **curve_figures([(t, a) for t, a in run["curve"]], target, budget_s)} for run in s["runs"]]
            systems[name] = aggregate(runs)
        out.append({**r, "systems": systems})
    return out


def spread(values: Sequence[float | None], missing: float) -> dict[str, float | None]:
    """Median, min and max, with None counted as `missing` (inf: never reached; -inf: no value)
    and reported as None wherever it decides the figure."""
    if not values:
        return {"median": None, "min": None, "max": None}
    xs = sorted(missing if v is None else float(v) for v in values)
    n = len(xs)
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {"median": finite(mid), "min": finite(xs[0]), "max": finite(xs[-1])}


def _at_step(entry: str) -> int:
    """The step of a "what@step" entry (an unknown step sorts first)."""
    step = entry.rpartition("@")[2]
    return int(step) if step.isdigit() else -1


def run_result(record: RunRecord, workers: int, target: float, budget_s: float) -> dict[str, Any]:
    """One run's figures (pure): from the DDP baseline's rank files or from our report.json."""
    report = record.report or {}
    decisions = [d for d in report.get("decisions") or [] if isinstance(d, Mapping)]
    if record.rank_docs:
        base = ddp_result(record.rank_docs, 0.0, 0.0, workers)
        rank0 = next((d for d in record.rank_docs if d.get("rank") == 0), {})
        points = accuracy_points(rank0.get("validationCurve"))
        modes = [f"{record.system} ({len(record.rank_docs)} workers)"]
    elif record.report is not None:
        base = sgdjob_result(record.report, 0.0, 0.0)
        points = accuracy_points(record.report.get("validation_curve"))
        # Mode switches are in the timeline already; a rebalance or a resize is not. In step order.
        changes = [f"{d.get('action')}@{d.get('step')}" for d in decisions if d.get("action") != "switchMode"]
        modes = sorted([*base["modes"], *changes], key=_at_step)
        # Per-rank batches at the end (a static split, or the policy's last rebalance).
        sizes = [r.get("batch_size") for r in record.report.get("per_rank") or [] if isinstance(r, Mapping)]
        if len(set(sizes)) > 1:
            modes.append(f"batches {sizes} at the end")
    else:
        base, points, modes = {"ok": False}, [], []
    ok = bool(base.get("ok")) and record.error is None
    return {
        **curve_figures(points, target, budget_s),
        "final_accuracy": points[-1][1] if points else None,
        "throughput": base.get("throughput"),
        "wall_s": base.get("wall_s"),
        "harness_s": record.harness_s,
        "modes": modes,
        # What the policy did and why: each decision's step, action, predicted gain and reason
        # (which names the statistical efficiency it rested on: measured or assumed).
        "decisions": [{k: d.get(k) for k in ("step", "action", "mode", "predictedGain", "reason")} for d in decisions],
        "ok": ok,
        "error": record.error,
        "curve": points,
    }


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system's figures over seeds (pure)."""
    return {
        "time_to_target_s": spread([r["time_to_target_s"] for r in runs], math.inf),
        "accuracy_at_budget": spread([r["accuracy_at_budget"] for r in runs], -math.inf),
        "first_crossing_s": spread([r.get("first_crossing_s") for r in runs], math.inf),
        "last_accuracy_at_budget": spread([r.get("last_accuracy_at_budget") for r in runs], -math.inf),
        "throughput": spread([r["throughput"] for r in runs], -math.inf),
        "reached": sum(r["time_to_target_s"] is not None for r in runs),
        "seeds": len(runs),
        "ok": all(r["ok"] for r in runs),
        "runs": list(runs),
    }


def fmt_number(value: Any, spec: str) -> str:
    """`value` formatted with `spec`, or a dash when it is not a number."""
    return format(value, spec) if isinstance(value, int | float) and not isinstance(value, bool) else "—"


def spread_cell(s: Mapping[str, Any], spec: str, none: str = "—") -> str:
    """A `spread` as a table cell: median [min-max], or `none` when nothing was measured."""
    if s["median"] is None and s["min"] is None:
        return none
    median = fmt_number(s["median"], spec) if s["median"] is not None else none
    return f"{median} [{fmt_number(s['min'], spec)}-{fmt_number(s['max'], spec) if s['max'] is not None else none}]"


def markdown_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per scenario and system: median [min-max] over seeds (pure)."""
    lines = [
        f"| scenario | system | time to target (s, mean of {SUSTAIN}) | reached "
        f"| accuracy at budget (mean of {SUSTAIN}) | first single crossing (s) | single accuracy at budget "
        "| throughput (samples/s) | modes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for system in SYSTEMS:
            s = r["systems"].get(system)
            if s is None:
                continue
            modes = "; ".join(sorted({", ".join(run["modes"]) or "—" for run in s["runs"]}))
            errors = [run["error"] for run in s["runs"] if run.get("error")]
            lines.append(
                f"| {r['scenario']} | {system} | {spread_cell(s['time_to_target_s'], '.1f', 'not reached')} "
                f"| {s['reached']}/{s['seeds']} | {spread_cell(s['accuracy_at_budget'], '.3f')} "
                f"| {spread_cell(s['first_crossing_s'], '.1f', 'not reached')} "
                f"| {spread_cell(s['last_accuracy_at_budget'], '.3f')} "
                f"| {spread_cell(s['throughput'], '.0f')} | {'ERROR ' + errors[0] if errors else modes} |"
            )
    return "\n".join(lines) + "\n"
