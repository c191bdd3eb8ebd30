"""The project's one error type for bad input.

Every user-facing failure (a malformed file, an unknown preset, an impossible layout, a plan that does not fit)
raises RackcastError with a one-line message that names the file and the field. The CLI turns it into that line on
stderr and exit code 2; anything else that escapes is a bug (or an input no check foresaw):
the front ends print `unexpected_error_line` (one line, exit code 1) and show the traceback only with `--debug`.

Library code names no command-line flag: an error about one input of a request (planner.search.Request's `usable`,
say) passes `option=` with that input's name, and each front end says how its user sets it (the CLI prefixes the
flag whose argparse dest has that name: "--usable-gpus: ...").
"""

SHOWN_CHARS = 200  # an unexpected error's message is cut to this many characters


class RackcastError(Exception):
    """Bad input: the message is one line naming the file and field at fault; `option` names the request input."""

    def __init__(self, message: str, *, where: str = "", option: str = ""):
        self.where, self.option = where, option
        text = f"{where}: {message}" if where else message
        super().__init__(" ".join(text.split()))


def unexpected_error_line(exc: BaseException, rerun_hint: str) -> str:
    """One line for an exception that is not bad input, with how to see its traceback (`rerun_hint`)."""
    message = " ".join(str(exc).split())
    if len(message) > SHOWN_CHARS:
        message = message[:SHOWN_CHARS - 3] + "..."
    return f"internal error: {type(exc).__name__}{': ' + message if message else ''} ({rerun_hint})"
