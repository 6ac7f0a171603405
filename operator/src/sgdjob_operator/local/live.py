"""The rich live view of `sgdjob run` on a terminal: per-worker speed bars, mode, step, loss,
throughput against the bound, ETA, and each decision with its reason as it happens."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from sgdjob_operator.local.progress import ProgressFrame, RunInfo
from sgdjob_operator.local.report import summary_lines

MAX_NOTES = 8


def eta_seconds(snap: ProgressFrame, total_steps: int, first: ProgressFrame | None) -> float | None:
    """Seconds left at the average step rate so far; None before there is a rate."""
    if first is None or snap.step <= first.step or snap.time <= first.time:
        return None
    rate = (snap.step - first.step) / (snap.time - first.time)
    return max(0.0, (total_steps - snap.step) / rate)


class RichDisplay:
    """A `Display` that redraws one live panel; notes (decisions) scroll above it."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._live: Live | None = None
        self._info: RunInfo | None = None
        self._first: ProgressFrame | None = None
        self._notes: deque[str] = deque(maxlen=MAX_NOTES)

    def start(self, info: RunInfo) -> None:
        self._info = info
        for line in info.notes:
            self.console.print(f"[yellow]note:[/] {line}")
        self.console.print(
            f"[bold]sgdjob run {info.job}[/]: {info.nodes} local node(s), {info.workers} worker process(es), "
            f"mode {info.mode}, {info.steps} steps"
        )
        self.console.print(f"output: {info.out_dir}")
        self._live = Live(Text("starting workers ..."), console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    def render(self, snap: ProgressFrame) -> Panel:
        info = self._info
        total = info.steps if info else 0
        eta = eta_seconds(snap, total, self._first)
        rate = f"{snap.samples_per_s:,.0f}" if snap.samples_per_s is not None else "-"
        bound = snap.bound_per_s
        eff = f" ({snap.samples_per_s / bound:.0%} of bound)" if snap.samples_per_s is not None and bound > 0 else ""
        loss = f"{snap.loss:.4f}" if snap.loss is not None else "-"
        head = Text.assemble(
            ("mode ", "dim"), (snap.mode, "bold cyan"), ("   step ", "dim"), (f"{snap.step}/{total}", "bold"),
            ("   loss ", "dim"), (loss, "bold"), ("   samples/s ", "dim"), (rate, "bold"),
            (f" vs bound {bound:,.0f}{eff}", "dim"),
            ("   ETA ", "dim"), (f"{eta:.0f}s" if eta is not None else "-", "bold"),
        )  # fmt: skip
        table = Table(expand=True, box=None, pad_edge=False)
        for column in ("rank", "node", "speed (samples/s, never waiting)", "", "step", "wait s", "mode"):
            table.add_column(column)
        fastest = max((w.speed for w in snap.workers), default=0.0) or 1.0
        for w in snap.workers:
            style = "dim" if not w.fresh or w.done else ""
            bar = ProgressBar(total=fastest, completed=w.speed, width=30)
            table.add_row(
                str(w.rank), w.node or "-", bar, f"{w.speed:,.0f}", str(w.step), f"{w.wait_s:.1f}", w.mode, style=style
            )
        parts: list[Any] = [head, table]
        if self._notes:
            parts.append(Text("\n".join(self._notes), style="yellow"))
        return Panel(Group(*parts), title=info.job if info else "sgdjob", subtitle=f"{snap.elapsed_s:.0f}s")

    def update(self, snap: ProgressFrame) -> None:
        if self._first is None and snap.step > 0:
            self._first = snap
        if self._live is not None:
            self._live.update(self.render(snap))

    def note(self, text: str) -> None:
        self._notes.append(text)
        self.console.print(f"[yellow]{text}[/]") if self._live is None else self._live.console.print(
            f"[yellow]{text}[/]"
        )

    def resize(self, nodes: int, workers: int) -> None:
        if self._info is not None:
            self._info = replace(self._info, nodes=nodes, workers=workers)
        self._first = None  # the ETA restarts from the new world's pace

    def finish(self, report: Mapping[str, Any] | None, message: str) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if report is not None:
            for line in summary_lines(report):
                self.console.print(line)
        self.console.print(message)
