"""Compare screen: a plan file and a run folder (metrics.parquet + record.json from `rackcast train`): predicted
against measured per metric (validation.compare, as `rackcast compare` prints it) and a per-step plot of the measured
step time with the prediction as a line (textual-plotext).

Keys: enter in a field or ctrl+r loads. Part of the app in rackcast.tui.app.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static
from textual_plotext import PlotextPlot

from rackcast.tui.widgets import Field


@dataclass
class Comparison:
    plan_name: str
    source: str  # simulate | estimate
    rows: list[dict]  # validation.compare.compare_rows
    steps: list[int]
    step_times_s: list[float]
    predicted_step_s: float


def load_comparison(plan_path: str, run_dir: str) -> Comparison:
    """What `rackcast compare PLAN RUN_DIR` computes, plus the run's per-step times from metrics.parquet."""
    from rackcast.validation.compare import check_same_plan, compare_rows, load_record, predict
    from rackcast.plan import load_plan

    plan = load_plan(plan_path)
    rec = load_record(run_dir)
    check_same_plan(plan, rec, run_dir)
    source, result = predict(plan)
    steps, times = [], []
    metrics = Path(run_dir) / "metrics.parquet"
    if metrics.exists():
        import pyarrow.parquet as pq

        table = pq.read_table(metrics, columns=["step", "step_time_s"]).to_pydict()
        steps, times = table["step"], table["step_time_s"]
    return Comparison(plan.name, source, compare_rows(result, rec, plan), steps, times, float(result.step_time_s))


COLUMNS = ("metric", "predicted", "measured", "error")


def metric_cells(rows: list[dict]) -> list[list[str]]:
    from rackcast.cli.compare import _fmt  # the CLI's number formats, so both print the same cells

    return [[r["metric"], _fmt(r["predicted"], r["unit"]), _fmt(r["measured"], r["unit"]),
             "-" if math.isnan(r["error"]) else f"{100 * r['error']:+.1f}%"] for r in rows]


class CompareScreen(Screen):
    BINDINGS = [Binding("ctrl+r", "load", "Load")]
    DEFAULT_CSS = """
    CompareScreen #paths { height: auto; padding: 0 1; }
    CompareScreen #status { height: 1; padding: 0 1; }
    CompareScreen #body { height: 1fr; }
    CompareScreen DataTable { width: 1fr; height: 1fr; }
    CompareScreen #plot { width: 1fr; height: 1fr; }
    """

    def __init__(self, plan_path: str = "", run_dir: str = "") -> None:
        super().__init__()
        self.plan_path, self.run_dir = plan_path, run_dir
        self.comparison: Comparison | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="paths"):
            yield Field("plan file", self.plan_path, field_id="cmp-plan", placeholder="examples/plans/x.yaml")
            yield Field("run folder", self.run_dir, field_id="cmp-run", placeholder="runs/NAME")
        yield Static("enter or ctrl+r: load the plan and the run", id="status")
        with Vertical(id="body"):
            yield DataTable(id="metrics", cursor_type="row", zebra_stripes=True)
            yield PlotextPlot(id="plot")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for col in COLUMNS:
            table.add_column(col)
        if self.plan_path and self.run_dir:
            self.action_load()

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_load()

    @on(Input.Changed)
    def _clear(self, event: Input.Changed) -> None:
        self.query_one(f"#field-{event.input.id}", Field).set_error("")

    def action_load(self) -> None:
        plan_field, run_field = self.query_one("#field-cmp-plan", Field), self.query_one("#field-cmp-run", Field)
        plan, run = plan_field.value, run_field.value
        ok = True
        if not plan or not Path(plan).is_file():
            plan_field.set_error("no such file" if plan else "give a plan YAML file")
            ok = False
        if not run or not (Path(run) / "record.json").is_file():
            run_field.set_error("no record.json in this folder" if run else "give a run folder")
            ok = False
        if ok:
            self.query_one("#status", Static).update("predicting and reading the run...")
            self.compute(plan, run)

    @work(thread=True, exclusive=True)
    def compute(self, plan: str, run: str) -> None:
        try:
            comparison = load_comparison(plan, run)
        except Exception as exc:  # RackcastError for bad files; anything else is shown too, never raised
            self.app.call_from_thread(self.query_one("#status", Static).update, f"[b]could not compare[/b]: {exc}")
            return
        self.app.call_from_thread(self.show, comparison)

    def show(self, c: Comparison) -> None:
        self.query_one("#status", Static).update(
            f"{c.plan_name}: predicted ({c.source}) vs measured; error = (predicted - measured) / measured")
        table = self.query_one(DataTable)
        table.clear(columns=True)
        cells = metric_cells(c.rows)
        # Each column as wide as its widest cell, set explicitly: the table's own auto-widths were seen to stay at
        # the headers' widths in one full-suite run ("step_t"), though never in a run of the TUI tests alone.
        for i, col in enumerate(COLUMNS):
            table.add_column(col, width=max(len(col), *(len(row[i]) for row in cells)))
        for row in cells:
            table.add_row(*row)
        plt = self.query_one(PlotextPlot).plt
        plt.clear_data()
        plt.clear_figure()
        plt.title("step time per step (s): measured, and predicted as a line")
        if c.steps:
            plt.plot(c.steps, c.step_times_s, marker="braille", label="measured")
            plt.hline(c.predicted_step_s)
            plt.text("predicted", c.steps[len(c.steps) // 2], c.predicted_step_s)
        self.query_one(PlotextPlot).refresh()
        self.comparison = c  # last: whoever waits for it (capture) finds the table and plot filled
