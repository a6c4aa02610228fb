"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class UsageError(ValueError):
    """Bad user input: a config field, a data directory, an existing results file.

    The message names the field (or path) and what is allowed, on one line.
    """
