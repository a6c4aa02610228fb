"""HDF5 files on file systems that give no locks.

HDF5 locks every file it opens (``flock``), and refuses to open one where the file
system cannot lock: an NFS mount without a lock daemon answers ``ENOLCK``, a Lustre
or GPFS mount without ``flock`` support ``ENOSYS``. On such a cluster every results
file, and every ``.h5`` dataset, would be unreadable and unwritable, while
``HDF5_USE_FILE_LOCKING=FALSE`` is folklore users find only after a failed job.
``File`` opens with HDF5's lock where the file system has one, and without it where it
has none. Nothing is lost there: fedmpi's own lock (``fedmpi.results.lock``) is skipped
on such a file system too, and the writer record still tells a live run on this host.

A process that opened a file without the lock must open it so again (HDF5 refuses a
second handle whose locking differs): the file systems found lockless are remembered.
"""

from __future__ import annotations

import errno
import os

import h5py

NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)

_lockless: set[int] = set()   # st_dev of the file systems where flock failed so


def File(path, mode: str = "r", **kwargs) -> h5py.File:
    """``h5py.File(path, mode, **kwargs)``, without HDF5's lock where the file system has
    none. An explicit ``locking`` is passed through as given; file objects have no lock."""
    if "locking" in kwargs or not isinstance(path, (str, os.PathLike)):
        return h5py.File(path, mode, **kwargs)
    device = _device(path)
    if device is not None and device in _lockless:
        return h5py.File(path, mode, locking=False, **kwargs)
    try:
        return h5py.File(path, mode, **kwargs)
    except OSError as exc:
        if exc.errno not in NO_LOCKS or "lock" not in str(exc):
            raise
    if device is not None:
        _lockless.add(device)
    return h5py.File(path, mode, locking=False, **kwargs)


def _device(path) -> int | None:
    """The file system of ``path``, or of its folder where it does not exist yet."""
    for where in (path, os.path.dirname(os.path.abspath(path))):
        try:
            return os.stat(where).st_dev
        except OSError:
            continue
    return None
