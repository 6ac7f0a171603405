"""The goodput benchmark's targets, checked against a run's results (pure), so a full run says itself
which it met, with the figures and the per-seed ratios behind each verdict.

    python -m bench.goodput_targets DIR/goodput.json             # re-check a finished run
    python -m bench.goodput_targets --rescore DIR/goodput.json   # by the current definitions, from its curves

A target needs its scenario and systems in the run; one that a subset run did not measure says so.
Medians are compared as the targets state them (auto's median against the other's median); the
per-seed ratios (auto against the same seed's other run, which trains from the same initial model
on the same data order) show how much of a margin is run-to-run spread.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.goodput_scoring import markdown_table, rescore

# Accuracy is compared in points (0.005 = half a point).
ACCURACY_SLACK = 0.005


@dataclass(frozen=True, slots=True)
class Check:
    target: str
    scenario: str
    # None: not measured in this run (`why` says what was missing).
    met: bool | None
    figure: str
    why: str = ""


def _systems(results: Sequence[Mapping[str, Any]], scenario: str) -> Mapping[str, Any] | None:
    return next((r["systems"] for r in results if r.get("scenario") == scenario), None)


def _median(system: Mapping[str, Any], key: str) -> float | None:
    value = system[key]["median"]
    return float(value) if isinstance(value, int | float) else None


def _per_seed(auto: Mapping[str, Any], other: Mapping[str, Any]) -> list[float | None]:
    """auto's time to target over the other's, seed by seed (None where either never reached it)."""
    out: list[float | None] = []
    for a, b in zip(auto["runs"], other["runs"], strict=False):
        ta, tb = a.get("time_to_target_s"), b.get("time_to_target_s")
        out.append(ta / tb if isinstance(ta, int | float) and isinstance(tb, int | float) and tb > 0 else None)
    return out


def _fmt_ratios(ratios: Sequence[float | None]) -> str:
    return ", ".join("—" if r is None else f"{r:.2f}" for r in ratios)


def time_ratio(
    results: Sequence[Mapping[str, Any]], scenario: str, limit: float, against: str | None, label: str
) -> Check:
    """auto's median time to target <= `limit` x `against`'s (None: the best other system's)."""
    systems = _systems(results, scenario)
    if systems is None or "auto" not in systems:
        return Check(label, scenario, None, "", f"{scenario} or auto not in this run")
    others = {k: v for k, v in systems.items() if k != "auto" and (against is None or k == against)}
    if not others:
        return Check(label, scenario, None, "", f"{against or 'no other system'} not in this run")

    # A system that never reached the target (median None) is infinitely late.
    def late(kv: tuple[str, Mapping[str, Any]]) -> tuple[float, str]:
        t = _median(kv[1], "time_to_target_s")
        return (math.inf if t is None else t, kv[0])

    name, other = min(others.items(), key=late)
    auto_t, other_t = _median(systems["auto"], "time_to_target_s"), _median(other, "time_to_target_s")
    seeds = _fmt_ratios(_per_seed(systems["auto"], other))
    if auto_t is None:
        return Check(label, scenario, False, f"auto never reached the target (median); {name} {other_t}", "")
    if other_t is None:
        return Check(label, scenario, True, f"auto {auto_t:.2f} s; {name} never reached the target (median)")
    if other_t <= 0.0:  # reached at the first validation, before training: no ratio to take
        return Check(label, scenario, auto_t <= 0.0, f"auto {auto_t:.2f} s; {name} reached the target at 0 s")
    ratio = auto_t / other_t
    # One more digit where three would print the limit itself for a ratio just above it.
    shown = f"{ratio:.3f}" if f"{ratio:.3f}" != f"{limit:.3f}" else f"{ratio:.4f}"
    figure = f"auto {auto_t:.2f} s / {name} {other_t:.2f} s = {shown}x (limit {limit:g}x; per seed {seeds})"
    return Check(label, scenario, ratio <= limit, figure)


def accuracy_kept(results: Sequence[Mapping[str, Any]], scenario: str) -> Check:
    """auto's median accuracy at the budget >= DDP's - ACCURACY_SLACK."""
    label = "accuracy at budget >= DDP - 0.5 points"
    systems = _systems(results, scenario)
    if systems is None or "auto" not in systems or "ddp" not in systems:
        return Check(label, scenario, None, "", f"{scenario}, auto or ddp not in this run")
    a, d = _median(systems["auto"], "accuracy_at_budget"), _median(systems["ddp"], "accuracy_at_budget")
    if a is None or d is None:
        return Check(label, scenario, None, "", "no validation before the budget")
    diff = (a - d) * 100
    per_seed = [
        (x.get("accuracy_at_budget"), y.get("accuracy_at_budget"))
        for x, y in zip(systems["auto"]["runs"], systems["ddp"]["runs"], strict=False)
    ]
    seeds = ", ".join(
        f"{(x - y) * 100:+.1f}" if isinstance(x, int | float) and isinstance(y, int | float) else "—"
        for x, y in per_seed
    )
    figure = f"auto {a:.3f} - DDP {d:.3f} = {diff:+.1f} points (per seed {seeds})"
    return Check(label, scenario, a >= d - ACCURACY_SLACK - 1e-12, figure)


def decisions_explained(results: Sequence[Mapping[str, Any]]) -> Check:
    """Every auto decision states its predicted gain and the statistical efficiency it rested on."""
    label = "every auto decision states its predicted gain and basis"
    runs = [run for r in results if "auto" in r["systems"] for run in r["systems"]["auto"]["runs"]]
    if not runs:
        return Check(label, "all", None, "", "auto not in this run")
    decisions = [d for run in runs for d in run.get("decisions") or []]
    basis = "statistical efficiency"  # every decision's reason names it, measured or assumed
    bad = [
        d
        for d in decisions
        if not isinstance(d.get("predictedGain"), int | float) or basis not in (d.get("reason") or "")
    ]
    figure = f"{len(decisions) - len(bad)} of {len(decisions)} decisions"
    return Check(label, "all", not bad, figure)


def check(results: Sequence[Mapping[str, Any]]) -> list[Check]:
    """The targets of the goodput issue, in its order."""
    checks = [
        time_ratio(results, "one-straggler", 0.55, "ddp", "time to target <= 0.55x DDP"),
        time_ratio(results, "one-straggler", 1.05, None, "time to target <= 1.05x the best other system"),
        time_ratio(results, "homogeneous", 1.03, "ddp", "time to target <= 1.03x DDP"),
        time_ratio(results, "bimodal", 1.05, None, "time to target <= 1.05x the best other system"),
        time_ratio(results, "intermittent", 1.05, None, "time to target <= 1.05x the best other system"),
    ]
    scenarios = [str(r["scenario"]) for r in results]
    checks += [accuracy_kept(results, s) for s in scenarios]
    checks.append(decisions_explained(results))
    return checks


def markdown(checks: Sequence[Check]) -> str:
    """The checks as a table (pure)."""
    lines = ["| target | scenario | met | figures |", "|---|---|---|---|"]
    for c in checks:
        verdict = "not measured" if c.met is None else ("yes" if c.met else "**no**")
        lines.append(f"| {c.target} | {c.scenario} | {verdict} | {c.figure or c.why} |")
    return "\n".join(lines) + "\n"


def as_json(checks: Sequence[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("goodput_json", type=Path, help="a run's goodput.json")
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="recompute every run's figures from its stored validation curve by the current definitions "
        "(bench.goodput_scoring), e.g. for a run written before them; prints the table too",
    )
    args = parser.parse_args(argv)
    try:
        doc = json.loads(args.goodput_json.read_text())
        results = doc["results"]
        if args.rescore:
            meta = doc["metadata"]
            results = rescore(results, float(meta["target_accuracy"]), float(meta["budget_s"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"{args.goodput_json}: not a goodput.json ({err})")
    if args.rescore:
        print(markdown_table(results))
    checks = check(results)
    print(markdown(checks), end="")
    return 0 if all(c.met is not False for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
