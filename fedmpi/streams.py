"""A run outlives its terminal output: ``fedmpi run exp.toml | head`` must not kill it.

When the reader of stdout (or stderr) goes away, every later write raises
BrokenPipeError: in the progress line of the next round, in a warning, at exit. A log
file on a full disk or over its quota (SLURM's ``slurm-%j.out``) raises OSError the same
way, though the results file may have room on another disk. A run's product is its
results file, so ``keep_going`` makes a stream that cannot be written a place that takes
every write: the descriptor is pointed at /dev/null (what Python leaves buffered, and
what MPI or HDF5 write to it, goes there too) and the run carries on. One line on
stderr, while stderr can still be written, says so and how to follow the run instead.
"""

from __future__ import annotations

import os
import sys

from .errors import warn


class _Unbreakable:
    """A text stream that sends itself to /dev/null the first time a write fails."""

    def __init__(self, stream, name: str, note: str):
        self._stream, self._name, self._note, self.gone = stream, name, note, False

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._unwritable(exc)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as exc:
            self._unwritable(exc)

    def _unwritable(self, exc: OSError) -> None:
        if self.gone:
            return
        self.gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        try:   # the bytes that failed are still buffered: now they go to /dev/null
            self._stream.flush()
        except OSError:
            pass
        if self._name == "stdout" and self._note:
            why = "was closed (broken pipe)" if isinstance(exc, BrokenPipeError) else \
                f"cannot be written ({(exc.strerror or str(exc)).lower()})"
            warn(f"fedmpi: stdout {why}; {self._note}")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def hold_standard_descriptors() -> None:
    """Point each of descriptors 0, 1 and 2 that is closed (`fedmpi run ... >&- 2>&-`, a
    daemon's child) at /dev/null. Left closed, the next file opened takes its number, the
    lock file or the results file, and whatever writes to stdout or stderr below Python
    (MPI, HDF5, an OpenMP or CUDA warning) writes into it: over the results file's
    first bytes, which left it unreadable."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)   # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def keep_going(note: str = "") -> None:
    """Make sys.stdout and sys.stderr survive their readers and their disks; ``note``
    (what happens now) ends the one line written when stdout fails."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbreakable):
            try:
                stream.fileno()
            except (AttributeError, OSError, ValueError):
                continue   # not a file (pytest's capture): nothing to point elsewhere
            setattr(sys, name, _Unbreakable(stream, name, note))
