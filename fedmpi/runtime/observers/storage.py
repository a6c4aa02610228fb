"""Stop while the results file still has room: a checkpoint that finds the disk full can
leave the file cut short (HDF5 had already extended it), and a file cut short cannot be
resumed. After each round the server compares the room left for the file, the free space
of its file system and ``ulimit -f``, with what the file may yet need: what the next
checkpoint adds (nothing once both slots hold every client with a state), the final
model, twice the most a round's rows have added so far, and 1 MiB. When the room is
short it checkpoints, marks the file ``interrupted`` and stops every rank, exit 75, as a
stop signal does; the line says how much room there is and how much is needed. Quotas
are not visible to the process: a write refused by one ends the run with one line
instead (``fedmpi.errors``)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from . import Observer
from .checkpoint import save
from .preemption import interrupt

MARGIN = 1 << 20


def room(path: Path, size: int) -> int | None:
    """Bytes ``path`` (now ``size`` bytes) may still grow by, or None when the file system
    does not say (a file system reporting no blocks at all, as some network and FUSE
    mounts do)."""
    try:
        fs = os.statvfs(path.parent)
    except OSError:
        return None
    if fs.f_blocks == 0:
        return None
    free = fs.f_bavail * fs.f_frsize
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        free = min(free, max(limit - size, 0))
    return free


class Storage(Observer):
    def __init__(self) -> None:
        self.start = None    # the file's size when the round began (its checkpoint written)
        self.rows = 0        # the most a round's rows have added to it

    def before_round(self, exp, t: int) -> None:
        if exp.comm.is_server:
            self.start = _size(exp.writer.path)

    def after_round(self, exp, record) -> None:
        path = exp.writer.path   # the file written (a resume through a link: its target)
        size = _size(path)
        if size is None:
            return
        if self.start is not None:
            self.rows = max(self.rows, size - self.start)
        if exp.stop is not None or record.round >= exp.config.rounds:
            return
        free = room(path, size)
        if free is None or free >= self.need(exp, bound=True):
            return
        need = self.need(exp)
        if free >= need:
            return
        completed = record.round
        if completed > 0:
            save(exp, completed)
        interrupt(exp, completed,
                  f"checkpointed after round {completed}" if completed else "stopped at round 0",
                  why=f"{path.parent} has {_mb(free)} free for {path.name}, less than the "
                      f"{_mb(need)} a checkpoint and the next rounds may need",
                  error=f"stopped before the storage was full ({_mb(free)} free, {_mb(need)} needed)")

    def need(self, exp, bound: bool = False) -> int:
        """The next checkpoint's growth, the final model, two rounds' rows and MARGIN;
        ``bound``: a whole checkpoint instead of its growth (no look into the file)."""
        server = sum(v.numel() * v.element_size() for v in exp.state.values())
        clients, each = len(exp.store), exp.store.state_bytes
        checkpoint = server + clients * each if bound else \
            exp.writer.checkpoint_growth(server, clients, each)
        model = exp.state["x"].numel() * 4
        return checkpoint + model + 2 * self.rows + MARGIN


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
