"""`rackcast tui`: the Textual terminal UI (rackcast.tui.app) — plan, size search, compare — in this terminal.

    rackcast tui
    rackcast tui --screen compare --plan PLAN.yaml --run runs/NAME
"""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("tui", help="terminal UI: plan a run, explore layouts and model sizes, compare")
    add_arguments(parser)
    parser.set_defaults(func=_run)


def add_arguments(parser) -> None:
    parser.add_argument("--screen", choices=("plan", "size", "compare"), default="plan", help="screen to open")
    parser.add_argument("--plan", default="", help="compare: the plan YAML to load")
    parser.add_argument("--run", default="", help="compare: the run folder (metrics.parquet, record.json)")
    parser.add_argument("--light", action="store_true", help="start in the light theme")


def _run(args) -> int:
    from rackcast.tui.app import run  # textual loads only when the TUI is asked for

    return run(args)
