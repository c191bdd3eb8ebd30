"""Plan screen: the form (model preset and shape, topology, racks, token budget, start, deadline), the layout search
running in a background process with a progress bar (cancellable), and the sortable candidate table.

Keys: ctrl+r (or enter in a field) run, escape cancel, s sort by the next column, S reverse, enter open the candidate's
detail; clicking a column header sorts by it.
Part of the app in rackcast.tui.app (`python tui.py`).
"""

from __future__ import annotations

import math

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, ProgressBar, Static

from rackcast.tui.jobs import Job
from rackcast.tui.planning import build_request, preset_shape
from rackcast.tui.widgets import GIB, Field, fmt_days, fmt_gib, fmt_rate, start_form_job

# The layout column is the parallel degrees and schedule; the knob columns (micro-batch, recomputation, optimizer
# state location, all-to-all transport) hold the rest, so rows that differ say how (on a narrow terminal they are
# to the right of the figures: scroll).
COLUMNS = (("#", "rank"), ("layout", "layout"), ("tok/s", "tokens_per_s"), ("MFU", "mfu"), ("mem", "memory"),
           ("P50 d", "days"), ("meets", "meets"), ("mb", "micro_batch"), ("rc", "recompute"), ("opt", "opt_location"),
           ("a2a", "transport"), ("steady d", "steady"), ("src", "source"))
KNOB_KEYS = ("micro_batch", "recompute", "opt_location", "transport")
DEFAULTS = {"model": "marin-535b-a23b", "topology": "gb200-nvl72", "racks": "11", "tokens": "18e12",
            "start": "", "deadline": ""}


class PlanScreen(Screen):
    BINDINGS = [
        Binding("ctrl+r", "run", "Run"),
        Binding("escape", "cancel", "Cancel"),
        Binding("s", "sort", "Sort"),
        Binding("S", "reverse", "Reverse", show=False),
        Binding("enter", "open", "Detail", show=True, priority=False),
    ]
    DEFAULT_CSS = """
    PlanScreen #form { grid-size: 5; grid-gutter: 0 1; height: auto; padding: 0 1; }
    PlanScreen #status-row { height: 1; padding: 0 1; }
    PlanScreen #progress { width: 22; }
    PlanScreen #status { width: 1fr; }
    PlanScreen DataTable { height: 1fr; }
    """

    def __init__(self, defaults: dict | None = None, request_options: dict | None = None) -> None:
        super().__init__()
        self.defaults = {**DEFAULTS, **(defaults or {})}
        self.request_options = request_options or {}
        self.job: Job | None = None
        self.result = None
        self.total_ranked = 0
        self.sort_key, self.sort_reverse = "rank", False
        self.timer = None

    def compose(self) -> ComposeResult:
        from rackcast.presets import list_models
        from rackcast.topologies import list_topologies

        yield Header()
        with Grid(id="form"):
            yield Field("model", self.defaults["model"], field_id="model")
            yield Field("topology", self.defaults["topology"], field_id="topology")
            yield Field("racks", self.defaults["racks"], field_id="racks")
            yield Field("tokens", self.defaults["tokens"], field_id="tokens")
            yield Field("start", self.defaults["start"], field_id="start", placeholder="YYYY-MM-DD")
            yield Field("width", field_id="width")
            yield Field("depth", field_id="depth")
            yield Field("experts", field_id="experts")
            yield Field("top-k", field_id="top_k")
            yield Field("deadline", self.defaults["deadline"], field_id="deadline", placeholder="YYYY-MM-DD")
        self._models, self._topologies = list_models(), list_topologies()
        with Horizontal(id="status-row"):
            yield ProgressBar(total=100, show_eta=False, id="progress")
            yield Static("enter or ctrl+r: search; F1: help", id="status")
        yield DataTable(id="candidates", cursor_type="row", zebra_stripes=True)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        from textual.suggester import SuggestFromList

        self.query_one("#model", Input).suggester = SuggestFromList(self._models)
        self.query_one("#topology", Input).suggester = SuggestFromList(self._topologies)
        self._fill_shape(self.defaults["model"])
        for key, value in self.defaults.items():
            if key in ("width", "depth", "experts", "top_k"):
                self.query_one(f"#{key}", Input).value = value
        table = self.query_one(DataTable)
        for title, key in COLUMNS:
            table.add_column(title, key=key)
        self.query_one(ProgressBar).update(total=100, progress=0)

    def _fill_shape(self, model: str) -> None:
        try:
            shape = preset_shape(model)
        except Exception:  # an unknown name is reported when the search starts
            return
        for key, value in shape.items():
            self.query_one(f"#{key}", Input).value = value

    @on(Input.Changed, "#model")
    def _model_changed(self, event: Input.Changed) -> None:
        if event.value.strip() in self._models:
            self._fill_shape(event.value.strip())
        self.query_one("#field-model", Field).set_error("")

    @on(Input.Changed)
    def _clear_error(self, event: Input.Changed) -> None:
        if event.input.id:
            self.query_one(f"#field-{event.input.id}", Field).set_error("")

    def values(self) -> dict[str, str]:
        return {f.id.removeprefix("field-"): f.value for f in self.query(Field)}

    def set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    # ------------------------------------------------------------ search
    def action_run(self) -> None:
        if self.job and not self.job.finished:
            self.set_status("a search is running (escape cancels it)")
            return
        job = start_form_job(self, lambda: build_request(self.values(), **self.request_options), "field-",
                             "rackcast.tui.jobs:run_search", "searching layouts... (escape cancels)")
        if job:
            self.job = job
            self.timer = self.set_interval(0.1, self._poll)

    def _poll(self) -> None:
        if not self.job:
            return
        for kind, *payload in self.job.poll():
            if kind == "progress":
                done, total, what = payload
                self.query_one(ProgressBar).update(total=total or None, progress=done)
                if what:
                    self.set_status(f"{what}... (escape cancels)")
            elif kind == "done":
                self._finish()
                self.show_result(payload[0].restore(), payload[0].total_ranked)
            elif kind == "error":
                self._finish()
                self.query_one(ProgressBar).update(total=100, progress=0)
                self.set_status(f"[b]search failed[/b]: {payload[0]}")

    def _finish(self) -> None:
        if self.timer:
            self.timer.stop()
            self.timer = None

    def action_cancel(self) -> None:
        if not self.job or self.job.finished:
            self.set_status("no search is running")
            return
        self.job.cancel()
        self._finish()
        self.query_one(ProgressBar).update(total=100, progress=0)
        self.set_status("search cancelled")

    def show_result(self, result, total_ranked: int | None = None) -> None:
        self.result = result
        self.total_ranked = total_ranked or len(result.ranked)
        self.query_one(ProgressBar).update(total=100, progress=100)
        c = result.counts
        shown = len(result.ranked)
        self.set_status(f"{c.get('ranked', shown):,} ranked of {c.get('enumerated', shown):,}"
                        f"{f', best {shown} shown' if shown < self.total_ranked else ''}; "
                        f"{c.get('simulated', 0)} simulated; mem: % of {fmt_gib(result.hbm_bytes)} HBM; "
                        "P50 d: days with failures; enter: detail")
        self.fill_table()
        self.query_one(DataTable).focus()

    # ------------------------------------------------------------ table
    def _value(self, row, key: str):
        r = self.result
        if key == "rank":
            return row.rank
        if key == "layout":
            return row.layout.label
        if key in KNOB_KEYS:
            return getattr(row.layout, key)
        if key == "steady":
            return row.best_days
        if key == "source":
            return "sim" if row.sim else "est"
        if key == "tokens_per_s":
            return row.best_tokens_per_s
        if key == "mfu":
            return row.best_mfu
        if key == "memory":
            return row.peak_memory
        if key == "days":
            return r.p50_days(row)
        meets = r.meets_deadline(row)
        return -1 if meets is None else int(meets)

    def fill_table(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        if self.result is None:
            return
        r = self.result

        def key(row):
            value = self._value(row, self.sort_key)
            return (isinstance(value, float) and math.isnan(value), value)

        rows = sorted(r.ranked, key=key, reverse=self.sort_reverse)
        for row in rows:
            meets = r.meets_deadline(row)
            lay = row.layout
            sched = lay.schedule if lay.parallel.pipeline > 1 else ""
            table.add_row(
                str(row.rank), f"{lay.parallel_label} {sched}".strip(), fmt_rate(row.best_tokens_per_s),
                f"{100 * row.best_mfu:.1f}%", f"{100 * row.peak_memory / r.hbm_bytes:.0f}%", fmt_days(r.p50_days(row)),
                "-" if meets is None else ("yes" if meets else "NO"), str(lay.micro_batch), lay.recompute,
                lay.opt_location, lay.transport, fmt_days(row.best_days), "sim" if row.sim else "est",
                key=str(id(row)))
        arrow = "v" if self.sort_reverse else "^"
        for title, col in COLUMNS:
            table.columns[col].label = f"{title}{arrow}" if col == self.sort_key else title
        table.refresh()

    def sort_by(self, key: str) -> None:
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key, self.sort_reverse = key, key in ("tokens_per_s", "mfu", "meets")
        self.fill_table()

    def action_sort(self) -> None:
        keys = [k for _, k in COLUMNS]
        self.sort_by(keys[(keys.index(self.sort_key) + 1) % len(keys)])

    def action_reverse(self) -> None:
        self.sort_by(self.sort_key)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_run()

    @on(DataTable.HeaderSelected)
    def _header(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    def selected_row(self):
        table = self.query_one(DataTable)
        if self.result is None or table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next((x for x in self.result.ranked if str(id(x)) == key), None)

    def action_open(self) -> None:
        row = self.selected_row()
        if row is None:
            self.set_status("run a search first (ctrl+r)")
            return
        from rackcast.tui.detail_screen import DetailScreen

        self.app.push_screen(DetailScreen(self.result, row))

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def on_unmount(self) -> None:
        if self.job and not self.job.finished:
            self.job.cancel()
