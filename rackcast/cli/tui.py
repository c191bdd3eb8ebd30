"""`rackcast tui`: the Textual terminal UI (rackcast.tui.app) — plan, size search, compare — in this terminal.

    rackcast tui
    rackcast tui --screen compare --plan PLAN.yaml --run runs/NAME
"""

from __future__ import annotations


from rackcast.tui.arguments import add_arguments


def register(sub) -> None:
    parser = sub.add_parser("tui", help="terminal UI: plan a run, explore layouts and model sizes, compare")
    add_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from rackcast.tui.app import run  # textual loads only when the TUI is asked for

    return run(args)
