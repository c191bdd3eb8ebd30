"""Plan detail screen for one candidate of the layout search: memory per GPU against HBM, step time by phase, the
pipeline schedule as a text Gantt (simulator.pipeline_exec), the simulated step's streams including the expert
all-to-all (simulator.step timeline), days to the budget against the deadline, and saving the plan YAML the CLI
writes for the same inputs.

Keys: ctrl+s save the plan (edit the path at the bottom, enter writes it), escape back. Part of the app in rackcast.tui.app.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, Static

from rackcast.simulator.metrics import band_text
from rackcast.tui.planning import Detail, detail
from rackcast.tui.widgets import fmt_days, fmt_rate, memory_bar, phase_bars, pipeline_gantt, stream_gantt


def days_text(d: Detail) -> Text:
    out = Text()
    out.append(f"{fmt_days(d.days)} days to the budget", style="bold")
    if d.days != d.steady_days:
        out.append(f" (P50 with failures; {fmt_days(d.steady_days)} steady state)")
    if math.isnan(d.available_days):
        out.append("; no deadline set")
        return out
    out.append(f" against {d.available_days:.0f} days to the deadline: ")
    out.append("meets it" if d.meets else "MISSES it", style="bold green" if d.meets else "bold red")
    if not math.isnan(d.deadline_prob):
        out.append(f" (P(finish by deadline) {100 * d.deadline_prob:.0f}%)")
    return out


def render_detail(d: Detail, width: int = 76) -> list[tuple[str, Text]]:
    """(section title, body) pairs: the detail screen's content, also used for text captures."""
    p = d.plan
    head = Text()
    head.append(d.label + "\n", style="bold")
    head.append(f"{fmt_rate(d.tokens_per_s)} tokens/s  MFU {100 * d.mfu:.1f}% of bf16 peak  step {d.step_s:.4g} s  "
                f"({'simulated' if d.source == 'simulate' else 'closed-form estimate'})\n")
    head.append_text(days_text(d))
    if d.band:
        head.append("\n" + band_text(d.band))
    sections = [("Candidate", head),
                ("Memory per GPU (heaviest pipeline rank) against HBM", memory_bar(d.memory, d.hbm_bytes, width - 28)),
                ("Step time by phase", phase_bars(d.phases, d.step_s, max(10, width - 50)))]
    if d.pipeline is not None:
        pr = d.pipeline
        sections.append((f"Pipeline schedule {p.schedule}: {pr.stages} ranks x {pr.microbatches} micro-batches"
                         f"{f' x {pr.virtual} chunks' if pr.virtual > 1 else ''}; bubble "
                         f"{100 * pr.bubble_fraction:.1f}% (schedule units)",
                         pipeline_gantt(pr.timelines, pr.total_s, width - 8)))
    else:
        sections.append(("Pipeline schedule", Text("one pipeline stage: no schedule to draw")))
    if d.sim is not None:
        tl = d.sim.timeline
        sections.append(("Simulated step, per stage and stream (simulator.step; expert all-to-all D/C)",
                         stream_gantt(tl.slices, tl.process_names, d.sim.step_time_s, width - 22)))
    elif d.sim_note:
        sections.append(("Simulated step", Text(d.sim_note + " (the figures above are the closed-form estimate's)")))
    return sections


class DetailScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("ctrl+s", "focus_save", "Save plan")]
    DEFAULT_CSS = """
    DetailScreen #body { height: 1fr; padding: 0 1; }
    DetailScreen .section-title { text-style: bold; color: $accent; margin-top: 1; }
    DetailScreen #save-row { height: 2; padding: 0 1; }
    DetailScreen #save-row Label { width: auto; padding-right: 1; }
    DetailScreen #save-path { width: 1fr; }
    DetailScreen #save-msg { height: 1; padding: 0 1; }
    """

    def __init__(self, result, row, detail_data: Detail | None = None) -> None:
        super().__init__()
        self.result, self.row = result, row
        self.data = detail_data

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(Static("computing the detail (simulating the step)...", id="loading"), id="body")
        with Horizontal(id="save-row"):
            yield Label("save plan to")
            yield Input(self._default_path(), id="save-path", compact=True)
        yield Static("", id="save-msg")
        yield Footer(compact=True)

    def _default_path(self) -> str:
        return f"{self.result.spec.name}-{self.result.request.topology}-{self.result.request.racks}.yaml"

    def on_mount(self) -> None:
        self.title = f"rackcast - detail #{self.row.rank}"
        if self.data is not None:
            self.show(self.data)
        else:
            self.compute()

    @work(thread=True, exclusive=True)
    def compute(self) -> None:
        try:
            data = detail(self.result, self.row)
        except Exception as exc:  # a planner or simulator error is shown, never raised into the UI
            self.app.call_from_thread(self._failed, f"{type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self.show, data)

    def _failed(self, message: str) -> None:
        self.query_one("#loading", Static).update(f"could not compute the detail: {message}")

    def show(self, data: Detail) -> None:
        self.data = data
        body = self.query_one("#body", VerticalScroll)
        body.remove_children()
        width = max(60, self.app.size.width - 4)
        widgets = []
        for title, text in render_detail(data, width):
            anchor = "sec-pipeline" if title.startswith("Pipeline schedule") else None
            widgets += [Static(title, classes="section-title", id=anchor), Static(text)]
        body.mount_all(widgets)

    def action_focus_save(self) -> None:
        self.query_one("#save-path", Input).focus()

    @on(Input.Submitted, "#save-path")
    def _save(self, event: Input.Submitted) -> None:
        self.save(event.value.strip())

    def save(self, path: str) -> str | None:
        """Write the plan file; returns the path written, or None with the reason shown inline."""
        from rackcast.plan import save_plan
        from rackcast.tui.planning import plan_with_prediction

        msg = self.query_one("#save-msg", Static)
        if not path:
            msg.update("[b]give a file name[/b], e.g. my-plan.yaml")
            return None
        target = Path(path).expanduser()
        if target.suffix not in (".yaml", ".yml"):
            msg.update(f"[b]{path}[/b]: a plan file ends in .yaml")
            return None
        if not target.parent.is_dir():
            msg.update(f"[b]{target.parent}[/b] is not a folder")
            return None
        try:
            plan = self.data.plan if self.data else plan_with_prediction(self.result, self.row)
            save_plan(plan, str(target))
        except OSError as exc:
            msg.update(f"[b]could not write {path}[/b]: {exc.strerror or exc}")
            return None
        msg.update(f"saved {target} (rackcast estimate/simulate/train read it)")
        return str(target)
