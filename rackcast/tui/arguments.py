"""The TUI's command-line arguments, shared by `rackcast tui` and `python tui.py` (textual is not imported here)."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--screen", choices=("plan", "size", "compare"), default="plan", help="screen to open")
    parser.add_argument("--plan", default="", help="compare: the plan YAML to load")
    parser.add_argument("--run", default="", help="compare: the run folder (metrics.parquet, record.json)")
    parser.add_argument("--light", action="store_true", help="start in the light theme")
