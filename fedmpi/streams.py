"""A run outlives its terminal output: ``fedmpi run exp.toml | head`` must not kill it.

When the reader of stdout (or stderr) goes away, every later write raises
BrokenPipeError: in the progress line of the next round, in a warning, at exit. A run's
product is its results file, so ``keep_going`` makes a closed stream a place that takes
every write: the descriptor is pointed at /dev/null (what Python leaves buffered, and
what MPI or HDF5 write to it, goes there too) and the run carries on. One line on
stderr, while stderr still has a reader, says so and how to follow the run instead.
"""

from __future__ import annotations

import os
import sys


class _Unbreakable:
    """A text stream that sends itself to /dev/null the first time its reader is gone."""

    def __init__(self, stream, name: str, note: str):
        self._stream, self._name, self._note, self.closed_reader = stream, name, note, False

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        if self.closed_reader:
            return
        self.closed_reader = True
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
            print(f"fedmpi: stdout was closed (broken pipe); {self._note}", file=sys.stderr,
                  flush=True)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def keep_going(note: str = "") -> None:
    """Make sys.stdout and sys.stderr survive their readers; ``note`` (what happens now)
    ends the one line written when stdout's reader is gone."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbreakable):
            try:
                stream.fileno()
            except (AttributeError, OSError, ValueError):
                continue   # not a file (pytest's capture): nothing to point elsewhere
            setattr(sys, name, _Unbreakable(stream, name, note))
