"""One writer per results file: an advisory lock held for the whole run.

The lock is ``flock`` on a hidden file beside the results file (``runs/.exp.h5.lock``),
holding the writer's identity. Not on the results file itself: HDF5 opens, closes and
locks that file on its own, and the kernel drops a process's POSIX locks on a file
whenever any descriptor of it is closed. ``flock`` locks vanish with the process, so a
crashed run never leaves a stale lock; the file itself is removed by a clean release.

Where the file system does not support ``flock`` the lock is skipped; the ``writer``
attribute in the results file (``fedmpi.results.liveness``) still catches a live writer
on the same host.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

from fedmpi.errors import UsageError
from fedmpi.results import liveness


def lock_path(results_path) -> Path:
    path = Path(results_path)
    return path.parent / f".{path.name}.lock"


class RunLock:
    """Held by the process that writes ``results_path``; ``release`` (or exit) frees it."""

    def __init__(self, results_path, fd: int | None):
        self.path, self._fd = lock_path(results_path), fd

    @classmethod
    def acquire(cls, results_path) -> "RunLock":
        """Take the lock or raise UsageError naming the live writer that holds it."""
        path = lock_path(results_path)
        for _ in range(10):   # the holder may release (and unlink) between open and flock
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise UsageError(f"results file {results_path}: cannot create {path} "
                                 f"({exc.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise UsageError(busy_message(results_path, holder)) from None
                path.unlink(missing_ok=True)   # no flock here: rely on the writer record
                return cls(results_path, None)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                lock = cls(results_path, fd)
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps(liveness.identity()).encode(), 0)
                except OSError as exc:   # a full disk: name the file, leave no lock behind
                    lock.release()
                    raise OSError(exc.errno, exc.strerror, str(path)) from None
                return lock
            os.close(fd)
        raise UsageError(f"results file {results_path}: could not take its lock {path}")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def holder(results_path) -> dict | None:
    """The identity of the live process holding the lock of ``results_path``, else None."""
    return liveness.flock_holder(lock_path(results_path), lambda fd: _read(fd) or {})


def busy_message(results_path, writer) -> str:
    return (f"results file {results_path} is being written by a live run "
            f"({liveness.describe(writer)}); stop that run first, or choose another output "
            f"with -o/--output")


def _read(fd: int) -> dict | None:
    try:
        value = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
