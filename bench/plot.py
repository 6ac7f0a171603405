"""The benchmarks' figures: efficiency and time to target grouped by scenario (heterogeneity), and
validation accuracy against wall time per scenario (goodput)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.results import SYSTEMS

COLORS = {
    "ddp": "#7f7f7f",
    "ddp-drop": "#17becf",
    "lb-bsp": "#9467bd",
    "sync": "#1f77b4",
    "hierarchical": "#2ca02c",
    "async": "#ff7f0e",
    "auto": "#d62728",
    "auto-default": "#8c564b",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _value(result: Mapping[str, Any], system: str, key: str) -> float:
    value = result["systems"].get(system, {}).get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def plot_results(results: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    plt = _pyplot()
    names = [r["scenario"] for r in results]
    width = 0.8 / len(SYSTEMS)
    fig, (eff_ax, ttt_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, system in enumerate(SYSTEMS):
        xs = [j + (i - (len(SYSTEMS) - 1) / 2) * width for j in range(len(names))]
        eff_ax.bar(xs, [_value(r, system, "efficiency") for r in results], width, label=system, color=COLORS[system])
        ttt_ax.bar(
            xs, [_value(r, system, "time_to_target_s") for r in results], width, label=system, color=COLORS[system]
        )
    eff_ax.set_ylabel("throughput / bound (Σ per-worker speeds)")
    eff_ax.set_ylim(0, 1.05)
    eff_ax.axhline(1.0, color="black", linewidth=0.5)
    ttt_ax.set_ylabel("time to target loss (s; 0 = not reached)")
    for ax in (eff_ax, ttt_ax):
        ax.set_xticks(range(len(names)), names)
        ax.grid(axis="y", alpha=0.3)
    eff_ax.legend(ncol=len(SYSTEMS), fontsize=8, loc="upper center", bbox_to_anchor=(1.1, -0.08))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(
    curves: Mapping[str, Sequence[Sequence[tuple[float, float]]]],
    path: Path,
    title: str,
    *,
    target: float,
    budget_s: float,
) -> Path:
    """Validation accuracy against seconds since training start: one line per system and seed
    (`curves[system]` = one [(time_s, accuracy)] per seed), the target and the wall-time budget."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for system, runs in curves.items():
        for i, points in enumerate(runs):
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=COLORS.get(system, "black"),
                alpha=1.0 if i == 0 else 0.45,
                linewidth=1.4,
                label=system if i == 0 else None,
            )
    ax.axhline(target, color="black", linewidth=0.7, linestyle="--", label=f"target {target:g}")
    ax.axvline(budget_s, color="black", linewidth=0.7, linestyle=":", label=f"budget {budget_s:g} s")
    ax.set_xlabel("seconds since training start")
    ax.set_ylabel("validation accuracy (held-out split)")
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("\n".join(textwrap.wrap(title, 100)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
