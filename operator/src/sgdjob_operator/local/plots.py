"""PNG plots of a local run from report.json: step times with mode changes, training and validation loss,
throughput vs bound."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a server or in CI

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

PLOT_FILES = ("step_times.png", "loss.png", "throughput.png")


def _mark_modes(ax: Axes, report: Mapping[str, Any]) -> None:
    # The runner's own clock (seconds since it started), the same as the other series.
    for t, mode in (report.get("timeline") or {}).get("mode_changes", []):
        ax.axvline(t, color="black", linestyle="--", linewidth=1)
        ax.annotate(
            str(mode), (t, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8
        )


def _subtitle(report: Mapping[str, Any]) -> str:
    emulation = report.get("emulation") or {}
    slept = emulation.get("computeSeconds", 0) > 0
    kind = "emulated compute" if slept else "real compute"
    if report.get("cpu_limits"):
        kind += ", real CPU quotas"
    return f"{report.get('job', '')} - {report.get('workers', '?')} workers, {kind}"


def write_plots(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write the three PNGs next to report.json; returns their paths."""
    timeline = report.get("timeline") or {}
    paths = [out_dir / name for name in PLOT_FILES]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    per_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for t, rank, step_time, _compute in timeline.get("ranks", []):
        per_rank[int(rank)].append((t, step_time))
    for rank, points in sorted(per_rank.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=f"rank {rank}")
    _mark_modes(ax, report)
    ax.set(
        xlabel="time since start (s)",
        ylabel="wall seconds per step",
        title=f"Per-rank step time, mode changes dashed\n{_subtitle(report)}",
    )
    if per_rank:
        ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    history = report.get("loss_history") or []
    if history:
        ax.plot([h[0] for h in history], [h[1] for h in history], label="training loss")
    validation = [p for p in report.get("validation_curve") or [] if p.get("loss") is not None]
    if validation:
        ax.plot([p["step"] for p in validation], [p["loss"] for p in validation], marker=".", label="validation loss")
    if report.get("target_step") is not None:
        ax.axvline(report["target_step"], color="black", linestyle="--", linewidth=1, label="target reached")
    if history or validation:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set(xlabel="step", ylabel="loss", title=f"Training and validation loss (held-out split)\n{_subtitle(report)}")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    job = [p for p in timeline.get("job", []) if p[2] is not None]
    if job:
        ax.plot([p[0] for p in job], [p[2] for p in job], label="throughput (samples/s)")
        ax.plot([p[0] for p in job], [p[3] for p in job], linestyle=":", label="bound: sum of per-worker speeds")
        ax.legend(fontsize=8)
    _mark_modes(ax, report)
    ax.set(
        xlabel="time since start (s)",
        ylabel="samples/s",
        title=f"Throughput vs bound (efficiency {report.get('efficiency', 0) or 0:.2f})\n{_subtitle(report)}",
    )
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    return paths
