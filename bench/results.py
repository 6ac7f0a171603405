"""Pure parts of the heterogeneity benchmark: loss curves, time to target, per-system results,
ratios, target checks and the markdown table. No processes, no clocks.

Time to target: the training loss (rank 0's per-step batch loss, the same quantity for every
system) smoothed by a trailing mean over SMOOTH_POINTS points, first at or below the target; the
time is seconds since that system's training started (after rendezvous and set-up). The target is
TARGET_MULTIPLE x the synthetic data's noise floor (the best reachable mean squared error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

SYSTEMS = ("ddp", "sync", "hierarchical", "async", "auto")
STATIC = ("sync", "hierarchical", "async")
TARGET_MULTIPLE = 3.0
SMOOTH_POINTS = 8

Curve = list[tuple[float, int, float]]  # (seconds since training start, step, loss)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def target_loss(noise_floor: float, multiple: float = TARGET_MULTIPLE) -> float:
    return multiple * noise_floor


def curve_from_report(report: Mapping[str, Any]) -> Curve:
    """`sgdjob run`'s report.json: loss_history rows are [step, loss, secondsSinceTrainingStart]."""
    out: Curve = []
    for row in report.get("loss_history") or []:
        if isinstance(row, list) and len(row) >= 3:
            loss, t = _finite(row[1]), _finite(row[2])
            if loss is not None and t is not None:
                out.append((t, int(row[0]), loss))
    return sorted(out)


def curve_from_ddp(doc: Mapping[str, Any]) -> Curve:
    """bench.ddp_baseline's rank file: lossCurve rows are [timeS, step, loss]; the step-0 row is
    the full-data initial loss, not a batch loss, and is left out like in our trainer's history."""
    out: Curve = []
    for row in doc.get("lossCurve") or []:
        if isinstance(row, list) and len(row) >= 3 and int(row[1]) > 0:
            t, loss = _finite(row[0]), _finite(row[2])
            if loss is not None and t is not None:
                out.append((t, int(row[1]), loss))
    return sorted(out)


def smoothed(curve: Curve, window: int = SMOOTH_POINTS) -> list[tuple[float, float]]:
    """(time, trailing mean of the last `window` losses); starts once a full window is there."""
    out = []
    for i in range(window - 1, len(curve)):
        chunk = curve[i - window + 1 : i + 1]
        out.append((curve[i][0], sum(p[2] for p in chunk) / window))
    return out


def time_to_target(curve: Curve, target: float, window: int = SMOOTH_POINTS) -> float | None:
    """First time the smoothed loss is at or below `target`; None when it never is."""
    for t, loss in smoothed(curve, window):
        if loss <= target:
            return t
    return None


def sgdjob_result(report: Mapping[str, Any], bound: float, target: float) -> dict[str, Any]:
    """One of our systems' results from its report.json; efficiency against the scenario bound."""
    throughput = _finite(report.get("throughput_samples_per_s")) or 0.0
    timeline = report.get("mode_timeline") or []
    return {
        "throughput": throughput,
        "efficiency": throughput / bound if bound > 0 else None,
        "time_to_target_s": time_to_target(curve_from_report(report), target),
        "final_loss": _finite(report.get("final_loss")),
        "wall_s": _finite(report.get("wall_s")),
        "measured_bound": _finite(report.get("bound_samples_per_s")),
        "modes": [f"{e.get('mode')}@{e.get('step')}" for e in timeline if isinstance(e, Mapping)],
        "ok": bool(report.get("ok", True)) and not report.get("missing_ranks"),
    }


def ddp_result(docs: Sequence[Mapping[str, Any]], bound: float, target: float, expected: int) -> dict[str, Any]:
    """The DDP baseline's result from its rank files, by the same definitions as report.json:
    all ranks' samples / the longest rank's training wall time; final loss = mean over ranks."""
    walls = [w for d in docs if (w := _finite(d.get("wallSeconds"))) is not None and w > 0]
    wall = max(walls) if walls else 0.0
    samples = sum(int(d.get("samples") or 0) for d in docs)
    throughput = samples / wall if wall > 0 else 0.0
    finals = [f for d in docs if (f := _finite(d.get("finalLoss"))) is not None]
    rank0 = next((d for d in docs if d.get("rank") == 0), None)
    computes = {int(d.get("rank", -1)): _finite(d.get("computeSeconds")) or 0.0 for d in docs}
    return {
        "throughput": throughput,
        "efficiency": throughput / bound if bound > 0 else None,
        "time_to_target_s": time_to_target(curve_from_ddp(rank0), target) if rank0 is not None else None,
        "final_loss": sum(finals) / len(finals) if finals else None,
        "wall_s": wall,
        # Emulated seconds only (ddp_baseline counts the sleep), so this is the config bound measured.
        "measured_bound": sum(
            int(d.get("samples") or 0) / c for d in docs if (c := computes.get(int(d.get("rank", -1)), 0.0)) > 0
        ),
        "modes": ["ddp"],
        "ok": len(docs) == expected,
    }


def failed_result(error: str) -> dict[str, Any]:
    return {
        "throughput": None,
        "efficiency": None,
        "time_to_target_s": None,
        "final_loss": None,
        "ok": False,
        "error": error,
    }


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b > 0:
        return float(a) / float(b)
    return None


def ratios(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """auto against DDP and against the best static mode of the same scenario (by throughput)."""
    auto, ddp = systems.get("auto", {}), systems.get("ddp", {})
    statics = {
        m: systems[m]["throughput"] for m in STATIC if isinstance(systems.get(m, {}).get("throughput"), int | float)
    }
    best = max(statics, key=lambda m: statics[m]) if statics else None
    return {
        "auto_over_ddp_throughput": _ratio(auto.get("throughput"), ddp.get("throughput")),
        "best_static": best,
        "auto_over_best_static_throughput": _ratio(auto.get("throughput"), statics[best]) if best else None,
        "auto_efficiency": auto.get("efficiency"),
        "auto_over_ddp_time_to_target": _ratio(auto.get("time_to_target_s"), ddp.get("time_to_target_s")),
    }


def _check(name: str, value: float | None, op: str, threshold: float) -> dict[str, Any]:
    met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
    return {"target": name, "value": value, "op": op, "threshold": threshold, "met": met}


def target_checks(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value (None = not measured or not reached)."""
    by_name = {r["scenario"]: r.get("ratios", {}) for r in results}
    checks = []
    if "one-straggler" in by_name:
        r = by_name["one-straggler"]
        checks += [
            _check("one-straggler: auto efficiency (of the bound)", r.get("auto_efficiency"), ">=", 0.85),
            _check("one-straggler: auto / DDP throughput", r.get("auto_over_ddp_throughput"), ">=", 1.8),
            _check("one-straggler: auto / DDP time to target", r.get("auto_over_ddp_time_to_target"), "<=", 0.7),
        ]
    if "homogeneous" in by_name:
        checks.append(
            _check(
                "homogeneous: auto / DDP throughput", by_name["homogeneous"].get("auto_over_ddp_throughput"), ">=", 0.97
            )
        )
    if "bimodal" in by_name:
        checks.append(
            _check(
                "bimodal: auto / best static throughput",
                by_name["bimodal"].get("auto_over_best_static_throughput"),
                ">=",
                0.95,
            )
        )
    return checks


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return format(value, spec) + suffix if isinstance(value, int | float) and not isinstance(value, bool) else "—"


def markdown_table(results: Sequence[Mapping[str, Any]], bounds: Mapping[str, float]) -> str:
    """One row per scenario and system, then the ratios per scenario and the target checks."""
    lines = [
        (
            "| scenario | system | throughput (samples/s) | efficiency (of bound) "
            "| time to target (s) | final loss | modes |"
        ),
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        name = r["scenario"]
        for system in SYSTEMS:
            s = r["systems"].get(system)
            if s is None:
                continue
            modes = s.get("error") or " → ".join(s.get("modes", []))
            lines.append(
                f"| {name} (bound {_fmt(bounds.get(name), '.0f')}) | {system} "
                f"| {_fmt(s.get('throughput'), '.0f')} | {_fmt(s.get('efficiency'), '.2f')} "
                f"| {_fmt(s.get('time_to_target_s'), '.1f')} | {_fmt(s.get('final_loss'), '.4f')} | {modes} |"
            )
    lines += [
        "",
        "| scenario | auto/DDP throughput | auto/best static (which) | auto efficiency | auto/DDP time to target |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        q = r.get("ratios", {})
        lines.append(
            f"| {r['scenario']} | {_fmt(q.get('auto_over_ddp_throughput'), '.2f', 'x')} "
            f"| {_fmt(q.get('auto_over_best_static_throughput'), '.2f', 'x')} ({q.get('best_static') or '—'}) "
            f"| {_fmt(q.get('auto_efficiency'), '.2f')} | {_fmt(q.get('auto_over_ddp_time_to_target'), '.2f', 'x')} |"
        )
    checks = target_checks(results)
    if checks:
        lines += ["", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
        for c in checks:
            met = "n/a" if c["met"] is None else ("yes" if c["met"] else "NO")
            lines.append(f"| {c['target']} | {_fmt(c['value'], '.2f')} | {c['op']} {c['threshold']:g} | {met} |")
    return "\n".join(lines) + "\n"
