"""The project's one error type for bad input.

Every user-facing failure (a malformed file, an unknown preset, an impossible layout, a plan that does not fit)
raises RackcastError with a one-line message that names the file and the field. The CLI turns it into that line on
stderr and exit code 2; nothing else is caught, so programming errors still show their traceback.

Library code names no command-line flag: an error about one input of a request (planner.search.Request's `usable`,
say) passes `option=` with that input's name, and each front end says how its user sets it (the CLI prefixes the
flag whose argparse dest has that name: "--usable-gpus: ...").
"""


class RackcastError(Exception):
    """Bad input: the message is one line naming the file and field at fault; `option` names the request input."""

    def __init__(self, message: str, *, where: str = "", option: str = ""):
        self.where, self.option = where, option
        text = f"{where}: {message}" if where else message
        super().__init__(" ".join(text.split()))
