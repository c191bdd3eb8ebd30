"""The TUI's command-line arguments, shared by `rackcast tui` and `python tui.py` (textual is not imported here)."""

from __future__ import annotations

import argparse


def add_arguments(parser) -> None:
    parser.add_argument("--screen", choices=("plan", "size", "compare"), default="plan", help="screen to open")
    parser.add_argument("--plan", default="", help="compare: the plan YAML to load")
    parser.add_argument("--run", default="", help="compare: the run folder (metrics.parquet, record.json)")
    parser.add_argument("--light", action="store_true", help="start in the light theme")
    # SUPPRESS: `rackcast --debug tui` sets it on the main parser, which this default must not overwrite
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an unexpected error")
