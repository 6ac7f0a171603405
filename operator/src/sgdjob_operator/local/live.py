"""The rich live view of `sgdjob run` on a terminal: per-worker speed bars, mode, step, loss,
throughput against the bound, ETA, and each decision with its reason as it happens."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from sgdjob_operator.local.progress import EtaTracker, ProgressFrame, RunInfo, eta_text, run_length
from sgdjob_operator.local.report import summary_lines
from sgdjob_operator.policy.eta import Eta

MAX_NOTES = 8


class RichDisplay:
    """A `Display` that redraws one live panel; notes (decisions) scroll above it."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._live: Live | None = None
        self._info: RunInfo | None = None
        self._eta = EtaTracker(0)
        self._last_eta: Eta | None = None
        self._notes: deque[str] = deque(maxlen=MAX_NOTES)

    def start(self, info: RunInfo) -> None:
        self._info = info
        self._eta = EtaTracker(info.steps, info.target)
        for line in info.notes:
            self.console.print(f"[yellow]note:[/] {line}")
        self.console.print(
            f"[bold]sgdjob run {info.job}[/]: {info.nodes} local node(s), {info.workers} worker process(es), "
            f"mode {info.mode}, {escape(run_length(info))}"  # a command's `[...]` is not markup
        )
        self.console.print(f"output: {info.out_dir}")
        self._live = Live(Text("starting workers ..."), console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    def render(self, snap: ProgressFrame) -> Panel:
        info = self._info
        total = info.steps if info else 0
        eta = self._last_eta
        rate = f"{snap.samples_per_s:,.0f}" if snap.samples_per_s is not None else "-"
        bound = snap.bound_per_s
        eff = f" ({snap.samples_per_s / bound:.0%} of bound)" if snap.samples_per_s is not None and bound > 0 else ""
        loss = f"{snap.loss:.4f}" if snap.loss is not None else "-"
        head = Text.assemble(
            ("mode ", "dim"), (snap.mode_shown, "bold cyan"), ("   step ", "dim"), (f"{snap.step}/{total}", "bold"),
            ("   loss ", "dim"), (loss, "bold"), ("   samples/s ", "dim"), (rate, "bold"),
            (f" vs bound {bound:,.0f}{eff}", "dim"),
            ("   ETA ", "dim"), (eta_text(eta), "bold"),
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
        self._last_eta = self._eta.update(snap)
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
        self._eta.reset()  # the ETA restarts from the new world's pace

    def finish(self, report: Mapping[str, Any] | None, message: str) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if report is not None:
            for line in summary_lines(report):
                self.console.print(line)
        self.console.print(message)
