"""What a rank does when its experiment fails: the results file's status, the lock, and
with MPI one line naming the cause before the job is aborted (fedmpi.errors).

The file is marked ``failed`` or ``interrupted`` with the error (unless the disk is full:
then it is left open, and ``--resume`` recovers it like a killed run's). Under MPI a
usage error, a full disk or an out-of-memory ends the job with one line (exit 2 for bad
input, else 1); anything else prints its traceback first.
"""

from __future__ import annotations

import sys
import traceback

from ..errors import (ALONE_AFTER, UsageError, ended_within, out_of_memory, out_of_memory_message,
                      storage_full, storage_full_message, warn)
from ..results.writer import FileReplacedError


def fail(exp, exc: BaseException) -> None:
    """``exp`` (fedmpi.runtime.experiment.Experiment) failed with ``exc`` on this rank."""
    if exp.store is not None:
        exp.store.close()
    full = storage_full(exc)
    if exp.writer is not None:
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        try:
            try:
                exp.writer.set_status(status, error=f"{type(exc).__name__}: {exc}")
            except FileReplacedError:
                pass   # not our file any more: leave it alone
            exp.writer.close()
        except (OSError, RuntimeError):
            if full is None:
                raise
            # the disk is full: the status cannot be written either; the file, left
            # open, is recovered by --resume like a killed run's
        exp.writer = None
    if exp.comm.size > 1:
        exp.release()   # before the abort, which ends this process: no lock file left
        oom = None if full else out_of_memory(exc)
        if isinstance(exc, UsageError) or full or oom:  # one line: exit 2 (bad input) or 1
            # in setup every rank meets the same error: the server speaks for all; memory
            # runs out on a rank of its own (a GPU worker), which says which
            if oom:
                warn(f"fedmpi: rank {exp.comm.rank}: {out_of_memory_message(oom)}")
            elif exp.comm.is_server or exp.ready:
                message = storage_full_message(full) if full else exc
                warn(f"fedmpi: {message}")
            elif not ended_within(ALONE_AFTER):
                # the server's abort ends the job: aborting first could take the server
                # before it spoke; an error still unsaid by then was this rank's alone
                warn(f"fedmpi: rank {exp.comm.rank}: {exc}")
            exp.comm.abort(2 if isinstance(exc, UsageError) else 1)
        traceback.print_exc()
        sys.stderr.flush()
        exp.comm.abort(1)
