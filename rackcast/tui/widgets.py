"""Text renderings and small widgets shared by the TUI screens: a memory bar against HBM, step-time phase bars,
text Gantt charts of a pipeline schedule (simulator.pipeline_exec timelines) and of the step simulator's streams
(simulator.step timelines: compute, expert all-to-all, gradient reductions), and a labelled input with an inline
error line. The render functions return rich Text and take plain numbers, so tests can check them directly.

    from rackcast.tui.widgets import memory_bar, phase_bars, pipeline_gantt, stream_gantt
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Label, Static

from rackcast.units import GIB, MIB
MEMORY_PARTS = ("weights", "gradients", "master", "optimizer", "activations", "buffers")
# Colours that read on both light and dark backgrounds; every bar also uses distinct characters, so it reads
# without colour too.
PART_STYLE = {"weights": ("W", "bold blue"), "gradients": ("G", "bold magenta"), "master": ("M", "bold cyan"),
              "optimizer": ("O", "bold dark_orange"), "activations": ("A", "bold green"),
              "buffers": ("B", "bold red")}
KIND_STYLE = {"F": "bold blue", "B": "bold dark_orange", "BW": "bold dark_orange", "W": "bold green"}


def fmt_gib(n_bytes: float) -> str:
    """GiB, or MiB below one GiB (tiny CPU models)."""
    if n_bytes is None or math.isnan(n_bytes):
        return "-"
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB else f"{n_bytes / MIB:.1f} MiB"


def fmt_days(days: float) -> str:
    if days is None or math.isnan(days):
        return "-"
    return "inf" if math.isinf(days) else (f"{days:.1f}" if days >= 0.1 else f"{days:.2g}")


def fmt_rate(n: float) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3g}{prefix}"
    return f"{n:.3g}"


def memory_bar(memory: dict, hbm_bytes: float, width: int = 60) -> Text:
    """One bar: each part of memory per GPU in its own letter, scaled so the HBM line sits at `width`
    (or further right when the parts overflow it)."""
    total = sum(memory.get(p, 0.0) for p in MEMORY_PARTS)
    scale = width / max(hbm_bytes, total, 1.0)
    out = Text()
    used = 0
    for part in MEMORY_PARTS:
        cells = round(memory.get(part, 0.0) * scale)
        letter, style = PART_STYLE[part]
        out.append(letter * cells, style=style)
        used += cells
    hbm_at = round(hbm_bytes * scale)
    if used < hbm_at:
        out.append("·" * (hbm_at - used), style="dim")
    out.append("|", style="bold")
    out.append(f" {fmt_gib(total)} of {fmt_gib(hbm_bytes)} HBM ({100 * total / hbm_bytes:.0f}%)")
    out.append("\n")
    out.append("  ".join(f"{PART_STYLE[p][0]}={p} {fmt_gib(memory.get(p, 0.0))}" for p in MEMORY_PARTS
                         if memory.get(p, 0.0) > 0))
    host = memory.get("host", 0.0)
    if host:
        out.append(f"  host (offloaded) {fmt_gib(host)}")
    return out


def phase_bars(phases: dict, step_s: float, width: int = 40) -> Text:
    """A bar per step-time phase (exposed time), its seconds and share of the step."""
    out = Text()
    name_w = max((len(k) for k in phases), default=5)
    for name, secs in phases.items():
        share = secs / step_s if step_s > 0 else 0.0
        out.append(f"{name:<{name_w}} ")
        out.append("█" * round(share * width), style="bold blue")
        out.append(f" {secs:.4g} s {100 * share:.1f}%\n")
    out.append(f"{'step':<{name_w}} {step_s:.4g} s (seconds; exposed parts only)")
    return out


def _cells(start: float, end: float, total: float, width: int) -> range:
    a = int(start / total * width)
    b = max(a + 1, int(round(end / total * width)))
    return range(min(a, width - 1), min(b, width))


def pipeline_gantt(timelines, total_s: float, width: int = 64) -> Text:
    """Rows per pipeline rank; each action is drawn with its micro-batch number (mod 10), coloured by kind
    (F forward, B/BW backward, W weight gradient); '·' is idle (bubble)."""
    out = Text()
    for rank, entries in enumerate(timelines):
        cells: list[tuple[str, str]] = [("·", "dim")] * width
        for e in entries:
            kind = e.action.kind if hasattr(e.action, "kind") else str(e.action)
            mb = getattr(e.action, "microbatch", 0)
            for i in _cells(e.start_s, e.end_s, total_s, width):
                cells[i] = (str(mb % 10), KIND_STYLE.get(kind, "bold"))
        out.append(f"rank {rank:<2}│", style="bold")
        for ch, style in cells:
            out.append(ch, style=style)
        out.append("\n")
    out.append("digits: micro-batch; ")
    out.append("forward", style=KIND_STYLE["F"])
    out.append(" / ")
    out.append("backward", style=KIND_STYLE["B"])
    out.append(" / ")
    out.append("weight-grad", style=KIND_STYLE["W"])
    out.append(" / · idle")
    return out


OP_CODES = {"attention": "a", "router": "r", "shared experts": "s", "experts": "e", "head and loss": "h",
            "dispatch": "D", "combine": "C", "fsdp all-gather": "g", "grad reduce-scatter": "R",
            "grad all-reduce": "A", "expert grad all-reduce": "X", "send activations": "p", "send gradients": "p",
            "optimizer step": "o", "optimizer state in": "i", "optimizer state out": "u"}


def op_code(name: str) -> str:
    base = name.replace("recompute ", "").replace(" backward", "")
    code = OP_CODES.get(base) or (base[:1] or "?")
    return code.upper() if name.endswith("backward") and code.islower() else code


def stream_gantt(slices, process_names: dict, total_s: float, width: int = 56) -> Text:
    """Rows per (simulated stage, stream) from simulator.step's Timeline.slices (pid, thread, name, start_s, end_s):
    each cell shows the op that covers most of it. Compute forward ops are lower case, backward upper case;
    communication ops (expert all-to-all D/C, reductions R/A/X, gathers g, pipeline sends p) have their own rows."""
    rows: dict[tuple[int, str], list] = {}
    for pid, thread, name, start, end in slices:
        rows.setdefault((pid, thread), []).append((name, start, end))
    out = Text()
    seen: dict[str, str] = {}
    label_w = max((len(f"{p} {t}") for p, t in rows), default=8)
    for (pid, thread) in sorted(rows, key=lambda k: (k[0], k[1] != "compute", k[1])):
        cover = [0.0] * width
        cells = ["·"] * width
        for name, start, end in rows[(pid, thread)]:
            code = op_code(name)
            seen.setdefault(code, name.replace("recompute ", "").replace(" backward", ""))
            for i in _cells(start, end, total_s, width):
                lo, hi = i * total_s / width, (i + 1) * total_s / width
                overlap = max(min(end, hi) - max(start, lo), 1e-30)
                if overlap > cover[i]:
                    cover[i], cells[i] = overlap, code
        style = "bold blue" if thread == "compute" else ("bold dark_orange" if " ep" in thread else "bold green")
        out.append(f"{pid} {thread}".ljust(label_w) + "│", style="bold")
        out.append("".join(cells), style=style)
        out.append("\n")
    out.append("  ".join(f"{c}={n}" for c, n in sorted(seen.items())), style="dim")
    out.append(f"\n{total_s:.4g} s across; upper-case compute letters are backward; · idle")
    return out


class Field(Vertical):
    """A label, a one-line input and an inline error line (empty when the value is good)."""

    DEFAULT_CSS = """
    Field { height: auto; width: 1fr; }
    Field > Label { height: 1; color: $text-muted; }
    Field > Input { height: 1; }
    Field > .error { height: auto; color: $error; display: none; }
    """

    def __init__(self, label: str, value: str = "", *, field_id: str, placeholder: str = "") -> None:
        super().__init__(id=f"field-{field_id}")
        self._label, self._value, self._field_id, self._placeholder = label, value, field_id, placeholder

    def compose(self) -> ComposeResult:
        yield Label(self._label)
        yield Input(self._value, placeholder=self._placeholder, id=self._field_id, compact=True)
        yield Static("", classes="error")

    @property
    def value(self) -> str:
        return self.query_one(Input).value.strip()

    def set_error(self, message: str) -> None:
        error = self.query_one(".error", Static)
        error.update(message)
        error.display = bool(message)


def start_form_job(screen, build, field_prefix: str, target: str, busy_message: str):
    """Read a screen's form with `build()`: on bad input mark each field inline and return None; otherwise start the
    background job `target` (see rackcast.tui.jobs) with what `build` returned, spin the progress bar and return the
    job. The screen has a `set_status(text)` method and a ProgressBar."""
    from textual.widgets import ProgressBar

    from rackcast.tui.jobs import Job
    from rackcast.tui.planning import InputErrors

    for f in screen.query(Field):
        f.set_error("")
    try:
        payload = build()
    except InputErrors as exc:
        for name, message in exc.errors.items():
            screen.query_one(f"#{field_prefix}{name}", Field).set_error(message)
        screen.set_status(f"[b]check the form[/b]: {len(exc.errors)} field(s)")
        return None
    job = Job(target, payload).start()
    screen.query_one(ProgressBar).update(total=None, progress=0)
    screen.set_status(busy_message)
    return job
