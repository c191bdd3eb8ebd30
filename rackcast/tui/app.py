"""The rackcast Textual app: plan (layout search), detail, size search, compare and help screens.

    python tui.py            # from the repository root
    rackcast tui             # the same, through the CLI
    rackcast tui --screen compare --plan PLAN.yaml --run runs/NAME

An unexpected exception inside the app closes it and prints one line (exit 1); `--debug` shows Textual's traceback.
"""

from __future__ import annotations

import sys

from textual.app import App
from textual.binding import Binding

from rackcast.errors import RackcastError, unexpected_error_line
from rackcast.tui.plan_screen import PlanScreen


class RackcastApp(App):
    TITLE = "rackcast"
    ENABLE_COMMAND_PALETTE = False  # its footer entry would not fit 80 columns; every action has a key
    SUB_TITLE = "plan, size, compare"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("f2", "show('plan')", "Plan"),
        Binding("f3", "show('size')", "Size"),
        Binding("f4", "show('compare')", "Compare"),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, *, plan_defaults: dict | None = None, request_options: dict | None = None,
                 size_defaults: dict | None = None, compare_paths: tuple[str, str] | None = None,
                 start_screen: str = "plan", theme: str = "", debug: bool = False) -> None:
        super().__init__()
        self.show_tracebacks, self.crash = debug, None
        self.plan_defaults, self.request_options = plan_defaults, request_options
        self.size_defaults, self.compare_paths = size_defaults, compare_paths
        self.start_screen = start_screen
        if theme:
            self.theme = theme

    def on_mount(self) -> None:
        self.install_screen(PlanScreen(self.plan_defaults, self.request_options), "plan")
        self.push_screen("plan")
        if self.start_screen != "plan":
            self.action_show(self.start_screen)

    def action_show(self, name: str) -> None:
        if name not in self._installed_screens:
            if name == "size":
                from rackcast.tui.size_screen import SizeScreen

                self.install_screen(SizeScreen(self.size_defaults, self.request_options), name)
            elif name == "compare":
                from rackcast.tui.compare_screen import CompareScreen

                self.install_screen(CompareScreen(*(self.compare_paths or ("", ""))), name)
        while len(self.screen_stack) > 2:  # back to the base screen before switching
            self.pop_screen()
        self.switch_screen(name)

    def action_help(self) -> None:
        from rackcast.tui.help_screen import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def _handle_exception(self, error: Exception) -> None:
        """Textual's hook for an unhandled exception: without --debug, keep it for `run` to print in one line
        instead of Textual's full-screen traceback (still recorded as Textual does, so test pilots re-raise it)."""
        if self.show_tracebacks:
            super()._handle_exception(error)
            return
        self.crash = error
        if self._exception is None:
            self._exception = error
            self._exception_event.set()
        self.exit(return_code=1)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rackcast.tui.arguments import add_arguments

    parser = argparse.ArgumentParser(prog="tui.py", description="rackcast terminal UI")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    debug = getattr(args, "debug", False)
    app = RackcastApp(compare_paths=(args.plan, args.run), start_screen=args.screen,
                      theme="textual-light" if args.light else "", debug=debug)
    try:
        app.run()
    except RackcastError as exc:
        print(f"rackcast tui: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the front end's last line of defence
        if debug:
            raise
        app.crash = exc
    if app.crash is not None:
        print("rackcast tui: " + unexpected_error_line(app.crash, "rerun with --debug for the traceback"),
              file=sys.stderr)
        return 1
    return app.return_code or 0
