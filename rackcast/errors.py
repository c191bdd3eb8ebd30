"""The project's one error type for bad input.

Every user-facing failure (a malformed file, an unknown preset, an impossible layout, a plan that does not fit)
raises RackcastError with a one-line message that names the file and the field. The CLI turns it into that line on
stderr and exit code 2; nothing else is caught, so programming errors still show their traceback.
"""


class RackcastError(Exception):
    """Bad input: the message is one line naming the file and field at fault."""

    def __init__(self, message: str, *, where: str = ""):
        self.where = where
        text = f"{where}: {message}" if where else message
        super().__init__(" ".join(text.split()))
