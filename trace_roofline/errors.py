"""The one exception type the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from collections.abc import Mapping


class InputError(ValueError):
    """Bad user input: a missing or malformed file, an unknown name, a bad argument.

    The message is one line and names the file (when there is one) and the problem. Each
    library parameter it is about is in `parameters` and written `name` (backquoted) in the
    message, so that a front end can respell it as its own option (`spelled`).
    """

    def __init__(self, message: str, *parameters: str) -> None:
        super().__init__(message)
        self.parameters = parameters

    def __reduce__(self) -> tuple[type[InputError], tuple[str, ...]]:
        return type(self), (str(self), *self.parameters)

    def spelled(self, names: Mapping[str, str]) -> str:
        """The message with each of its parameters spelled as `names` says (a CLI's flags)."""
        message = str(self)
        for p in self.parameters:
            message = message.replace(f"`{p}`", names.get(p, p))
        return message
