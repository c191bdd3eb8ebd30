"""Help screen: what each screen shows and its keys. Opened with F1 from anywhere; escape or q closes it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# rackcast TUI

**Screens** (F2 plan, F3 size, F4 compare, from anywhere; tab moves between fields and tables)

- **Plan**: fill the form (model preset, or its width, depth, experts, top-k; topology and racks; token budget;
  start and deadline as YYYY-MM-DD), then **enter** in a field or **ctrl+r**. The layout search runs in a
  separate process; **escape** cancels it. In the table **s** sorts by the next column, **S** reverses (a header
  click sorts by that column) and **enter** opens a candidate.
- **Detail**: memory per GPU against HBM, step time by phase, the pipeline schedule and the simulated step's
  streams (expert all-to-all) as text Gantt charts, days against the deadline. **ctrl+s** goes to the file name,
  **enter** writes the plan YAML (the file `rackcast plan --out` writes); **escape** goes back.
- **Size**: the model-size search of a family: model size against days with the deadline as a line, and the
  table behind it. **ctrl+r** runs, **escape** cancels.
- **Compare**: a plan file and a run folder (metrics.parquet + record.json): predicted against measured as
  `rackcast compare` prints it, and the measured step time per step with the prediction as a line.

**Everywhere**: **F1** this help, **ctrl+t** light/dark theme, **ctrl+q** quit.

Units: tokens/s, MFU = model FLOPs / (step time x GPUs x dense bf16 peak), memory in GiB per GPU, days of
wall time to the token budget.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Close"), Binding("q", "app.pop_screen", "Close", show=False)]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 78; height: 22; border: round $accent; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)
