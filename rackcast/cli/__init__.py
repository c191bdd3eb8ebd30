"""The `rackcast` command line: one entry point, one module per subcommand group.

Each module in COMMAND_MODULES exposes `register(subparsers)`, which adds its subcommand(s) and sets
`func(args) -> int` on the parser. Bad input raises RackcastError anywhere below; `main` prints its one line on
stderr and exits 2, naming the flag that sets the input at fault (library errors name none: `RackcastError.option`
is the argparse dest) and, for a model without op counts, the command that counts them. Ctrl-C exits 130 without a
traceback. Heavy modules (torch, textual) are imported inside the handlers that need them, so `rackcast --help` and
planning commands start fast. Any other exception
is a bug: one line on stderr, exit 1, and the traceback with the global `--debug` flag (`rackcast --debug estimate
PLAN`).

    rackcast --help
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rackcast import __version__
from rackcast.errors import RackcastError, unexpected_error_line

COMMAND_MODULES = [
    "rackcast.cli.models",
    "rackcast.cli.topologies",
    "rackcast.cli.estimate",
    "rackcast.cli.forecast",
    "rackcast.cli.simulate",
    "rackcast.cli.plan",
    "rackcast.cli.size",
    "rackcast.cli.train",
    "rackcast.cli.calibrate",
    "rackcast.cli.compare",
    "rackcast.cli.validate",
    "rackcast.cli.tui",
]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line with exit code 2 (its default code, kept)."""

    def error(self, message: str):
        self.exit(2, f"rackcast {self.prog.partition(' ')[2] or ''}: error: {message}\n".replace("  ", " "))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rackcast", description="Plan, simulate, train and forecast large mixture-of-experts "
                                                  "training runs on racks of accelerators.")
    parser.add_argument("--version", action="version", version=f"rackcast {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def flag_for(parser: argparse.ArgumentParser, command: str, dest: str) -> str:
    """The option string (the longest) that subcommand `command` stores under `dest`, or ""."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = subs[0].choices.get(command) if subs else None
    for action in sub._actions if sub else ():
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return ""


def describe(exc: RackcastError, parser: argparse.ArgumentParser, command: str) -> str:
    """The error's line with what the command line adds: the flag of the input at fault, or how to count ops."""
    from rackcast.simulator.op_counts import OpCountsMissing

    text = str(exc)
    flag = flag_for(parser, command, exc.option) if exc.option else ""
    if flag:
        text = f"{flag}: {text.removeprefix(exc.option + ': ')}"  # the flag replaces the input's name
    if isinstance(exc, OpCountsMissing):
        text += f"; count them with: rackcast calibrate --op-counts MODEL (the preset or YAML file of {exc.model!r})"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RackcastError as exc:
        print(f"rackcast {args.command}: error: {describe(exc, parser, args.command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rackcast {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - the front end's last line of defence: no traceback without --debug
        if args.debug:
            raise
        print(f"rackcast {args.command}: " + unexpected_error_line(exc, f"rerun with `rackcast --debug "
                                                                        f"{args.command} ...` for the traceback"),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
