"""The heterogeneity benchmark's figure: efficiency and time to target, grouped by scenario."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.results import SYSTEMS

COLORS = {"ddp": "#7f7f7f", "sync": "#1f77b4", "hierarchical": "#2ca02c", "async": "#ff7f0e", "auto": "#d62728"}


def _value(result: Mapping[str, Any], system: str, key: str) -> float:
    value = result["systems"].get(system, {}).get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def plot_results(results: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
