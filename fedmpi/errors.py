"""The one exception type that the CLI turns into a one-line message and exit code 2, and
the decorator that does it for every command (``fedmpi``'s, the analysis and sweep
commands', the tools' scripts): below them all, so none imports another for it. The
decorator also turns a write that found the disk, the quota or ``ulimit -f`` exhausted,
and an allocation that found the memory exhausted (a model too large, ``ulimit -v``, a
GPU), into one line and exit 1: not bad input, but nothing a traceback would explain
better."""

from __future__ import annotations

import difflib
import errno
import functools
import os
import re
import resource
import socket
import sys
import time

from . import signals
from .signals import launcher_local_rank, launcher_rank   # light: no torch

EXIT_USAGE = 2
EXIT_FAILED = 1
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "file size limit exceeded (ulimit -f)"}


def warn(line: str) -> None:
    """``line`` and its newline on stderr in one write. Python's stderr writes through:
    ``print(..., file=sys.stderr)`` makes two writes, and under mpirun the launcher's own
    messages (an MPI_ABORT's banner) land between them, glued to the end of the line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def flush_streams() -> None:
    """Flush stdout and stderr before the process ends at once (``os._exit``, an MPI
    abort), so nothing already written is lost; a stream that is closed, or that cannot
    be written (the full storage may be its own), is skipped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _chain(exc: BaseException | None):
    """``exc``, then what it was raised from or while handling, and so on (once each)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_full(exc: BaseException | None) -> str | None:
    """'PATH: no space left on device' (or the quota, or ``ulimit -f``) when ``exc``, or
    an exception it was raised from or while handling, is a write that found the storage
    full; None otherwise. h5py reports HDF5's failed writes as RuntimeError or OSError
    whose text carries ``errno = 28`` and ``filename = '...'``."""
    for exc in _chain(exc):
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
    return None


def out_of_memory(exc: BaseException | None) -> str | None:
    """What could not be allocated, when ``exc`` (or an exception it was raised from or
    while handling) is an allocation that failed: torch's on a CPU or a GPU, or Python's
    MemoryError; None otherwise."""
    torch = sys.modules.get("torch")
    gpu = getattr(torch, "OutOfMemoryError", ()) if torch is not None else ()
    for exc in _chain(exc):
        text = str(exc)
        if gpu and isinstance(exc, gpu):   # "CUDA out of memory. Tried to allocate 2.00 GiB. ..."
            return ". ".join(text.split(". ")[:2]).rstrip(".")
        if isinstance(exc, RuntimeError) and "can't allocate memory" in text:
            found = re.search(r"tried to allocate (\d+) bytes", text)
            return f"cannot allocate {int(found.group(1)) / 1e9:.1f} GB" if found else \
                "cannot allocate memory"
        if isinstance(exc, MemoryError):
            return f"cannot allocate memory ({text})" if text else "cannot allocate memory"
        if isinstance(exc, ImportError) and "failed to map segment" in text:   # ulimit -v
            return f"cannot load {text.split(':')[0]} ({_address_space()})"
    return None


def _address_space() -> str:
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return "no address-space limit" if limit == resource.RLIM_INFINITY else \
        f"the address space is limited to {limit / 2 ** 30:.1f} GiB: ulimit -v"


def out_of_memory_message(what: str) -> str:
    if what.startswith("cannot load"):   # torch itself does not fit under ulimit -v
        return f"out of memory: {what}; raise the limit"
    return (f"out of memory: {what}; a smaller model, eval.batch_size or system.client_group "
            f"needs less (a run goes on from its last checkpoint with fedmpi run --resume FILE)")


def storage_full_message(full: str, run: bool = True) -> str:
    """The one line for ``storage_full``; ``run``: a command that writes a results file
    (the advice to resume is for it alone)."""
    if not run:   # `fedmpi config > /dev/full`, a report into a full disk
        return f"cannot write {full}; free space, or send it elsewhere"
    # fedmpi/runtime/state.py's spill directories: the room is needed there, not at -o
    where = ("free space there (client states past system.state_memory_mb spill into "
             "system.state_dir, or TMPDIR when it is unset)" if "/fedmpi-state-" in full else
             "free space (or choose another output)")
    return (f"cannot write {full}; {where}, then run again: "
            f"fedmpi run --resume FILE continues a run from its last readable checkpoint")


class UsageError(ValueError):
    """Bad user input: a config field, a data directory, an existing results file.

    The message names the field (or path) and what is allowed, on one line.
    """


def did_you_mean(word: str, choices, dotted: bool = True) -> str:
    """`` (did you mean 'train.lr'?)`` to append to a message about the unknown ``word``,
    or "" when no choice is close. Dotted names are matched by their last part: the same
    one in another section first (``lr``, ``eval.lr`` -> ``train.lr``), then the closest
    spelling in the same section (``train.lrr``, a preset ``defualt``), then in any.
    ``dotted=False``: a dot is just a character (file names)."""
    split = (lambda text: text.rpartition(".")) if dotted else (lambda text: ("", "", text))
    parts = {c: split(c) for c in sorted({str(c) for c in choices} - {word})}
    parent, _, leaf = split(word)
    close = [c for c, (_, _, last) in parts.items() if last.lower() == leaf.lower()]
    for section, cutoff in ((parent, 0.6), (None, 0.65)):   # None: every section, a bit closer
        if not close:
            leaves = {last for up, _, last in parts.values() if section in (None, up)}
            near = difflib.get_close_matches(leaf, sorted(leaves), n=1, cutoff=cutoff)
            close = [c for c, (up, _, last) in parts.items()
                     if near and last == near[0] and section in (None, up)]
    if not close:
        return ""
    names = [repr(c) for c in close[:3]]
    either = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    return f" (did you mean {either}?)"


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
            say(str(exc))
            sys.exit(EXIT_USAGE)
        except (OSError, RuntimeError, MemoryError, ImportError) as exc:
            full = storage_full(exc)
            if full is None:
                oom = out_of_memory(exc)
                if oom is None:
                    raise
                say(out_of_memory_message(oom))
                sys.exit(EXIT_FAILED)
            say(storage_full_message(full, run=command.__name__ in _RUNS))
            # at once: the interpreter's clean-up would free HDF5 objects of a file that
            # cannot be written, and their failing flushes print tracebacks (or crash)
            flush_streams()
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


ALONE_AFTER = 3.0   # seconds another node's rank waits for the job's end before it speaks


def say(message: str) -> None:
    """'fedmpi: <message>' on stderr from rank 0, which speaks for the job: bad input
    fails every rank alike, before MPI starts, and the launcher ends the job when rank 0
    exits. The other ranks wait for that end, so that rank 0 exits first (a rank's exit
    ends the job, which could take rank 0 before it spoke). A node's first rank that is
    still running ALONE_AFTER seconds later speaks, naming itself: the error was its
    node's alone (a plugin or a file missing there), and rank 0 went on without a word."""
    import click   # deferred: the CLI's (~0.1 s), which ``import fedmpi`` does without

    rank = launcher_rank()
    if rank == 0:
        click.echo(f"fedmpi: {message}", err=True)
    elif not ended_within(ALONE_AFTER) and launcher_local_rank() in (0, None):
        click.echo(f"fedmpi: rank {rank} on {socket.gethostname()}: {message}", err=True)


def ended_within(seconds: float) -> bool:
    """Whether the launcher stops this process (SIGTERM) within ``seconds``: when ``fedmpi
    run`` listens, the stop flag says so; elsewhere the signal ends the process."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if signals.requested():
            return True
        time.sleep(0.05)
    return signals.requested()
