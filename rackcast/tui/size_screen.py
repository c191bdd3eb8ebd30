"""Size screen: the model-size search (planner.size.size_search) in a background process — per shape of a family,
the best layout, tokens/s and days to the token budget — as a plot of model size against days with the deadline
as a line (textual-plotext) and the table behind it.

Keys: ctrl+r (or enter in a field) run, escape cancel. Part of the app in rackcast.tui.app.
"""

from __future__ import annotations

import math

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, ProgressBar, Static
from textual_plotext import PlotextPlot

from rackcast.tui.jobs import Job
from rackcast.tui.planning import build_size_request
from rackcast.tui.widgets import Field, fmt_days, fmt_rate, start_form_job

DEFAULTS = {"family": "marin-moe", "topology": "gb200-nvl72", "racks": "11", "tokens": "18e12", "start": "",
            "deadline": ""}


def size_rows(result) -> list[list[str]]:
    """The table behind the plot: one row per shape, smallest first."""
    rows = []
    for s in sorted(result.shapes, key=lambda s: s.spec.params_total):
        best = s.best
        meets = s.result.meets_deadline(best) if best else None
        rows.append([s.spec.name, f"{s.spec.params_total / 1e9:.0f}B", f"{s.spec.params_active / 1e9:.1f}B",
                     best.layout.parallel_label if best else "nothing fits",
                     fmt_rate(best.best_tokens_per_s) if best else "-", fmt_days(s.days) if best else "-",
                     "-" if meets is None else ("yes" if meets else "NO"), "*" if s.pareto else ""])
    return rows


class SizeScreen(Screen):
    BINDINGS = [Binding("ctrl+r", "run", "Run"), Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    SizeScreen #form { grid-size: 6; grid-gutter: 0 1; height: auto; padding: 0 1; }
    SizeScreen #status-row { height: 1; padding: 0 1; }
    SizeScreen #progress { width: 30; }
    SizeScreen #plot { height: 1fr; min-height: 8; }
    SizeScreen DataTable { height: 1fr; }
    """

    def __init__(self, defaults: dict | None = None, request_options: dict | None = None) -> None:
        super().__init__()
        self.defaults = {**DEFAULTS, **(defaults or {})}
        self.options = request_options or {}
        self.job: Job | None = None
        self.result = None
        self.timer = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Grid(id="form"):
            for key in DEFAULTS:
                yield Field(key, self.defaults[key], field_id=f"size-{key}",
                            placeholder="YYYY-MM-DD" if key in ("start", "deadline") else "")
        with Horizontal(id="status-row"):
            yield ProgressBar(total=100, show_eta=False, id="progress")
            yield Static("enter or ctrl+r: size search (minutes for big families)", id="status")
        yield PlotextPlot(id="plot")
        yield DataTable(id="shapes", cursor_type="row", zebra_stripes=True)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).update(total=100, progress=0)
        table = self.query_one(DataTable)
        for col in ("shape", "total", "active", "best layout", "tok/s", "days", "meets", "front"):
            table.add_column(col)
        self._plot()

    def values(self) -> dict[str, str]:
        return {f.id.removeprefix("field-size-"): f.value for f in self.query(Field)}

    def set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    @on(Input.Changed)
    def _clear_error(self, event: Input.Changed) -> None:
        self.query_one(f"#field-{event.input.id}", Field).set_error("")

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_run()

    def action_run(self) -> None:
        if self.job and not self.job.finished:
            self.set_status("a size search is running (escape cancels it)")
            return
        job = start_form_job(self, lambda: build_size_request(self.values(), **self.options), "field-size-",
                             "rackcast.tui.jobs:run_size", "searching model sizes... (escape cancels)")
        if job:
            self.job = job
            self.timer = self.set_interval(0.1, self._poll)

    def _poll(self) -> None:
        for kind, *payload in self.job.poll() if self.job else []:
            if kind == "progress":
                done, total, what = payload
                self.query_one(ProgressBar).update(total=total or None, progress=done)
            elif kind in ("done", "error"):
                self.timer.stop()
                if kind == "done":
                    self.show_result(payload[0].restore())
                else:
                    self.query_one(ProgressBar).update(total=100, progress=0)
                    self.set_status(f"[b]size search failed[/b]: {payload[0]}")

    def action_cancel(self) -> None:
        if not self.job or self.job.finished:
            self.set_status("no size search is running")
            return
        self.job.cancel()
        if self.timer:
            self.timer.stop()
        self.query_one(ProgressBar).update(total=100, progress=0)
        self.set_status("size search cancelled")

    def show_result(self, result) -> None:
        self.result = result
        self.query_one(ProgressBar).update(total=100, progress=100)
        feasible = sum(s.result is not None for s in result.shapes)
        self.set_status(f"{len(result.shapes)} shapes, {feasible} fit; * = Pareto front (size vs days)")
        table = self.query_one(DataTable)
        table.clear()
        for row in size_rows(result):
            table.add_row(*row)
        self._plot()

    def _plot(self) -> None:
        plot = self.query_one(PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title("model size (B params, total) against days to the token budget")
        plt.xlabel("days")
        plt.ylabel("B params")
        r = self.result
        if r is not None:
            pts = [(s.days, s.spec.params_total / 1e9) for s in r.shapes if s.result and math.isfinite(s.days)]
            front = sorted((s.days, s.spec.params_total / 1e9) for s in r.shapes if s.pareto)
            if pts:
                plt.scatter([d for d, _ in pts], [p for _, p in pts], marker="dot", label="shapes")
            if front:
                plt.plot([d for d, _ in front], [p for _, p in front], marker="braille", label="Pareto front")
            avail = next((s.result.available_days for s in r.shapes if s.result), math.nan)
            if not math.isnan(avail):
                plt.vline(avail)
                plt.text("deadline", avail, max(p for _, p in pts) if pts else 0)
        plot.refresh()
