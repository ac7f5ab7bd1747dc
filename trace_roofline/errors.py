"""The one exception type the CLI turns into a one-line message and exit code 2."""


class InputError(ValueError):
    """Bad user input: a missing or malformed file, an unknown name, a bad argument.

    The message is one line and names the file (when there is one) and the problem.
    """
