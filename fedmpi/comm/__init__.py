"""Communication: one interface over MPI and an in-process backend, both counted.

``make_comm()`` picks MPI when the process was started by a launcher (mpirun, srun)
with more than one rank, and the in-process backend otherwise, so that a plain
``fedmpi run`` never needs an MPI library.
"""

from __future__ import annotations

import os

from .base import Comm, Ledger, as_array
from .local import LocalComm
from .mpi import MPIComm   # mpi4py itself is loaded by MPIComm(), never by this import

_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def launched_size() -> int | None:
    """World size announced by an MPI launcher, or None when run directly."""
    for name in _LAUNCHER_SIZE_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    if "PMIX_RANK" in os.environ or "PMI_RANK" in os.environ:
        return -1  # launched, size unknown until MPI is initialised
    return None


def make_comm() -> Comm:
    size = launched_size()
    if size is None or size == 1:
        return LocalComm()
    comm = MPIComm()
    return comm if comm.size > 1 else LocalComm()


__all__ = ["Comm", "Ledger", "LocalComm", "as_array", "make_comm", "launched_size"]
