"""A results file whose writer died: ``recover_crashed`` makes one left open for writing
openable again from a clean copy, ``damaged`` says what is still readable in one cut
short. Both salvage into a hidden file beside it (``writer._temporary``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fedmpi import hdf5
from fedmpi.errors import UsageError
from fedmpi.results import liveness, repair, schema
from fedmpi.results.lock import busy_message
from fedmpi.results.writer import _temporary


def recover_crashed(path) -> str | None:
    """Make a file left by a writer that died openable again; the caller holds its lock.

    A writer killed while it had the file open leaves the consistency flags set in the
    superblock, and HDF5 refuses to open the file for writing. Everything readable is
    copied into a fresh file that replaces it in one rename, provided all that a resume
    needs survived (``repair.assess``); returns a line saying what was done, or None when
    the file needed nothing. A file cut short is refused with what is still readable.
    """
    path = Path(path)
    problem = damaged(path)
    if problem:
        raise UsageError(problem)
    sb = repair.inspect(path)
    if sb is None or not sb.open_for_write:
        return None
    if liveness.held_for_writing(path):   # evidence of a holder now, where the recorded
        # writer's liveness is a guess: fedmpi's own writers hold no flock (SWMR drops it)
        raise UsageError(liveness.held_message(path))
    writer = repair.recorded_writer(path)
    if liveness.state(writer) == liveness.ALIVE:
        raise UsageError(busy_message(path, writer))
    temporary = _temporary(path, "recover")
    try:
        found = _salvage(path, temporary)
        if not found.resumable:
            raise UsageError(f"results file {path} is damaged (left inconsistent by a writer "
                             f"that died) and cannot be resumed; {found.summary()}")
        _drop(temporary, found.lost)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    checkpoint = "" if found.checkpoint is None else f", checkpoint after round {found.checkpoint}"
    return (f"{path} was left open by a writer that died; continuing from a clean copy "
            f"({found.rounds} rounds{checkpoint})")


def damaged(path) -> str | None:
    """For a file cut short: one line with what is still readable in it; else None."""
    path = Path(path)
    why = repair.damage(path)
    if why is None:
        return None
    with tempfile.TemporaryDirectory(dir=path.parent if os.access(path.parent, os.W_OK) else None) as d:
        found = _salvage(path, Path(d) / "salvage.h5")
    return f"results file {path} is damaged ({why}) and cannot be resumed; {found.summary()}"


def _salvage(path: Path, copy: Path) -> repair.Assessment:
    return repair.assess(copy, repair.salvage(path, copy, schema.LIBVER))


def _drop(path: Path, names: list[str]) -> None:
    """Remove what ``assess`` found expendable (a half-written spare checkpoint slot), so
    the next checkpoint rebuilds it."""
    with hdf5.File(path, "r+") as f:
        for name in names:
            top = "/".join(name.split("/")[:2])
            if top in f:
                del f[top]
