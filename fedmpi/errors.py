"""The one exception type that the CLI turns into a one-line message and exit code 2, and
the decorator that does it for every command (``fedmpi``'s, the analysis and sweep
commands', the tools' scripts): below them all, so none imports another for it. The
decorator also turns a write that found the disk, the quota or ``ulimit -f`` exhausted
into one line and exit 1: not bad input, but nothing a traceback would explain better."""

from __future__ import annotations

import errno
import functools
import os
import re
import sys

from .signals import launcher_rank   # light: no torch

EXIT_USAGE = 2
EXIT_FAILED = 1
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "file size limit exceeded (ulimit -f)"}


def storage_full(exc: BaseException | None) -> str | None:
    """'PATH: no space left on device' (or the quota, or ``ulimit -f``) when ``exc``, or
    an exception it was raised from or while handling, is a write that found the storage
    full; None otherwise. h5py reports HDF5's failed writes as RuntimeError or OSError
    whose text carries ``errno = 28`` and ``filename = '...'``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (OSError, RuntimeError)):
            text = str(exc)
            code = getattr(exc, "errno", None)
            if code not in _FULL and (found := re.search(r"errno = (\d+)", text)):
                code = int(found.group(1))
            if code in _FULL:
                name = getattr(exc, "filename", None)
                if not name and (found := re.search(r"filename = '([^']*)'", text)):
                    name = found.group(1)
                return f"{name or 'the output'}: {_FULL[code]}"
        exc = exc.__cause__ or exc.__context__
    return None


def storage_full_message(full: str, run: bool = True) -> str:
    """The one line for ``storage_full``; ``run``: a command that writes a results file
    (the advice to resume is for it alone)."""
    if not run:   # `fedmpi config > /dev/full`, a report into a full disk
        return f"cannot write {full}; free space, or send it elsewhere"
    return (f"cannot write {full}; free space (or choose another output), then run again: "
            f"fedmpi run --resume FILE continues a run from its last readable checkpoint")


class UsageError(ValueError):
    """Bad user input: a config field, a data directory, an existing results file.

    The message names the field (or path) and what is allowed, on one line.
    """


_RUNS = ("run", "sweep")   # the commands that write results files (sweep --run-cell)


def one_line_errors(command):
    """Turn UsageError into 'fedmpi: <message>' and exit 2, and a write into full storage
    into one line and exit 1 (printed by rank 0 only)."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        sys.unraisablehook, sys.excepthook = _unraisable, _excepthook
        try:
            return command(*args, **kwargs)
        except UsageError as exc:
            _say(str(exc))
            sys.exit(EXIT_USAGE)
        except (OSError, RuntimeError) as exc:
            full = storage_full(exc)
            if full is None:
                raise
            _say(storage_full_message(full, run=command.__name__ in _RUNS))
            # at once: the interpreter's clean-up would free HDF5 objects of a file that
            # cannot be written, and their failing flushes print tracebacks (or crash)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except OSError:   # the full storage may be this stream's
                    pass
            os._exit(EXIT_FAILED)
    return wrapper


def _unraisable(unraisable) -> None:
    """HDF5 objects freed after a write found the storage full try to flush, fail again
    and would print a traceback each (h5py's ``__dealloc__``, through both hooks): the
    command reports the full storage itself, once."""
    if storage_full(unraisable.exc_value) is None:
        sys.__unraisablehook__(unraisable)


def _excepthook(kind, value, traceback) -> None:
    if storage_full(value) is None:
        sys.__excepthook__(kind, value, traceback)


def _say(message: str) -> None:
    if launcher_rank() == 0:
        import click

        click.echo(f"fedmpi: {message}", err=True)
