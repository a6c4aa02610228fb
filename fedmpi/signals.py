"""Stop requests: SIGUSR1 (SLURM ``--signal``), SIGTERM, SIGHUP and a first Ctrl-C set a
flag, nothing else.

Installed as the first thing ``fedmpi run`` does, before torch is imported, so a signal
that arrives while a rank is still starting up is remembered rather than killing it; the
runtime checks the flag after start-up and at every round boundary, checkpoints, marks
the file interrupted and exits 75. A second Ctrl-C stops at once (KeyboardInterrupt: the
file is marked interrupted and resumes from its last periodic checkpoint).

What a launcher does with a signal sent to *it* is the launcher's business: OpenMPI's
mpirun (PRRTE) forwards SIGUSR1 and SIGUSR2 to every rank, but answers SIGTERM, SIGINT
and SIGHUP by killing the ranks (SIGTERM, then SIGKILL 0.25 s later), too soon for any
checkpoint; srun and SLURM's scancel give the ranks SIGTERM and ``KillWait`` seconds
(often 30). ``jobs/mpirun.sh`` therefore turns a TERM/INT/HUP sent to it into USR1 for
mpirun.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# A plain flag, not a threading.Event: a handler runs between two bytecodes of whatever the
# main thread is doing, including another handler, and Event.set() takes a lock. A TERM
# and a USR1 arriving together (scancel under srun delivers both) then deadlocked the rank
# inside the first handler's set(), until KillWait's SIGKILL.
_requested = False


def _handler(signum, frame) -> None:
    global _requested
    if signum == signal.SIGINT:
        if _requested:
            raise KeyboardInterrupt
        if launcher_rank() == 0:
            try:   # an exception here would surface wherever the run was: never raise
                os.write(2, b"\nfedmpi: Ctrl-C: stopping after this round (checkpoint, exit 75); "
                            b"Ctrl-C again stops now\n")
            except OSError:   # stderr's reader is gone (`2>&1 | head`) or its disk full
                pass
    _requested = True


def launcher_rank() -> int:
    """This process's rank as the launcher announced it (0 when started directly): known
    before MPI starts, so rank 0 alone can speak for the job."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def launcher_local_rank() -> int | None:
    """This process's rank among the launcher's ranks on its node (None: not announced)."""
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def install() -> dict | None:
    """Route the stop signals to the flag; returns the previous handlers (None when not
    on the main thread, where Python cannot install handlers). A hang-up or interrupt
    that is ignored (``nohup``, a background job of a script) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {}
    for sig in SIGNALS:
        if sig in (signal.SIGHUP, signal.SIGINT) and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, _handler)
    return previous


def restore(previous: dict | None) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def requested() -> bool:
    return _requested


def clear() -> None:
    global _requested
    _requested = False
