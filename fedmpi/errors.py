"""The one exception type that the CLI turns into a one-line message and exit code 2, and
the decorator that does it for every command (``fedmpi``'s, the analysis and sweep
commands', the tools' scripts): below them all, so none imports another for it."""

from __future__ import annotations

import functools
import sys

from .signals import launcher_rank   # light: no torch

EXIT_USAGE = 2


class UsageError(ValueError):
    """Bad user input: a config field, a data directory, an existing results file.

    The message names the field (or path) and what is allowed, on one line.
    """


def one_line_errors(command):
    """Turn UsageError into 'fedmpi: <message>' and exit 2 (printed by rank 0 only)."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UsageError as exc:
            if launcher_rank() == 0:
                import click

                click.echo(f"fedmpi: {exc}", err=True)
            sys.exit(EXIT_USAGE)
    return wrapper
