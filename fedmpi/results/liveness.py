"""Who writes a results file, and whether that process is still alive.

The writer (rank 0) records itself in the root attribute ``writer`` when it creates or
resumes a file: host, pid, and the process's start time (so a recycled pid is not taken
for the writer). Anyone on the same host can then tell a live run from a dead one;
from another host the answer is "unknown" and callers fall back to the file's progress.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import socket
from pathlib import Path

ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"
CRASHED = "crashed"   # not a stored status: a file that says running, written by no one


def left_by_the_dead(parent: Path, prefix: str, rest: str) -> list[Path]:
    """What processes on this host that are gone left in ``parent`` under names
    ``{prefix}{host}.{pid}{rest}`` (``rest`` a glob that starts with no digit): the
    temporaries and spill directories of runs killed outright, which nothing else removes."""
    host = socket.gethostname()
    start = f"{prefix}{host}."
    found = []
    for path in Path(parent).glob(f"{glob.escape(start)}*{rest}"):
        pid = re.match(r"\d+", path.name[len(start):])
        if pid and state({"host": host, "pid": int(pid.group())}) == GONE:
            found.append(path)
    return found


def identity(pid: int | None = None) -> dict:
    """This process (or ``pid``) as the writer attribute records it."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}


def state(writer) -> str:
    """ALIVE, GONE or UNKNOWN for a recorded writer (None or malformed: UNKNOWN)."""
    if not isinstance(writer, dict) or not isinstance(writer.get("pid"), int):
        return UNKNOWN
    if writer.get("host") != socket.gethostname():
        return UNKNOWN
    pid = writer["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return GONE
    except PermissionError:  # exists, another user's
        pass
    if _zombie(pid):
        return GONE  # exited, not yet reaped by its parent
    recorded, now = writer.get("start"), _start_time(pid)
    if recorded and now and recorded != now:
        return GONE  # the pid was reused by another process
    return ALIVE


def seen_status(status: str, writer) -> str:
    """A file's status as seen from this host: CRASHED for one that still says "running"
    while the writer it records is gone (kill -9, the OOM killer, a lost node); the stored
    status otherwise (also "running" when the writer cannot be checked from here)."""
    return CRASHED if status == "running" and state(writer) == GONE else status


def flock_holder(path, read=lambda fd: True):
    """``read(fd)`` (an open descriptor of ``path``) when another process holds an
    exclusive flock on ``path``; None when none does, or it cannot be told (no file, no
    flock on its file system). The kernel drops a flock with its process: a held one has
    a live holder."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # released by the close below
    except OSError as exc:
        return read(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EACCES) else None
    finally:
        os.close(fd)
    return None


def held_for_writing(path) -> bool:
    """Whether a live process has the file open for writing outside SWMR (an
    ``h5py.File(path, "a")`` in a notebook): HDF5 holds an exclusive flock on it for as
    long as that file is open, whatever the file's ``writer`` attribute says."""
    return flock_holder(path) is not None


def held_message(path) -> str:
    return (f"results file {path} is held open for writing by another process "
            f"(an h5py.File(..., 'a') in a notebook?); close it there and run again")


def describe(writer) -> str:
    """'pid 123 on host-1' for messages."""
    if not isinstance(writer, dict):
        return "an unknown process"
    return f"pid {writer.get('pid', '?')} on {writer.get('host', '?')}"


def _stat(pid: int) -> list[bytes]:
    """/proc/<pid>/stat's fields after the command name (field 3 on), [] where absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _zombie(pid: int) -> bool:
    return _stat(pid)[:1] == [b"Z"]


def _start_time(pid: int) -> str:
    """Boot id + start time in clock ticks since boot (Linux); '' where /proc has neither."""
    fields = _stat(pid)
    if len(fields) < 20:
        return ""
    ticks = fields[19].decode()   # field 22: start time in clock ticks after boot
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}:{ticks}"
