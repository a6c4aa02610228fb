"""The communication interface every rank talks through, and its byte ledger.

Collectives move flat buffers (numpy arrays or CPU torch tensors) and small picklable
objects. Every call is counted in the ledger as the bytes this rank sends and receives
in a flat (non-tree) implementation of the collective, so the numbers are independent
of the MPI library's internal algorithms and add up to the same totals on any machine:

- bcast of n bytes: the root sends n to each other rank; each other rank receives n.
- reduce of n bytes: each non-root rank sends n; the root receives n per other rank.
- gatherv: each rank sends its own part; the root receives the sum of the others.
- allreduce of n bytes: every rank sends and receives n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Ledger:
    """Bytes and seconds of this rank since the last ``take()``."""

    sent: int = 0
    received: int = 0
    calls: int = 0
    comm_seconds: float = 0.0   # inside collectives, once every rank had arrived
    idle_seconds: float = 0.0   # waiting for the other ranks to arrive

    def take(self) -> "Ledger":
        snapshot = Ledger(self.sent, self.received, self.calls, self.comm_seconds,
                          self.idle_seconds)
        self.sent = self.received = self.calls = 0
        self.comm_seconds = self.idle_seconds = 0.0
        return snapshot


def as_array(buf) -> np.ndarray:
    """A numpy view of ``buf`` (numpy array or CPU torch tensor), no copy."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError("comm moves host buffers; copy device tensors to the host first")
        return buf.detach().numpy()
    return buf


def pieces(part) -> list[np.ndarray]:
    """A part of ``alltoallv`` as its list of 1-D arrays (a single array is one piece)."""
    return [as_array(p).reshape(-1) for p in (part if isinstance(part, (list, tuple)) else [part])]


def received_into(out, size: int, dtype, what: str) -> np.ndarray:
    """Where a collective receives ``size`` values of ``dtype``: a new array, or the start
    of ``out`` (1-D, that dtype, at least that long), which a caller keeps from one call
    to the next so that big receives do not fault in fresh pages every time."""
    if out is None:
        return np.empty(size, dtype=dtype)
    if out.ndim != 1 or out.dtype != dtype or out.size < size or not out.flags.c_contiguous:
        raise ValueError(f"{what}: out must be a contiguous 1-D {np.dtype(dtype)} array of at "
                         f"least {size} values, got {out.dtype} {out.shape}")
    return out[:size]


def joined(part, out: np.ndarray | None = None, what: str = "alltoallv") -> np.ndarray:
    """A part of ``alltoallv`` (or any array or list of arrays), its pieces copied back to
    back into one 1-D array: a new one, or the start of ``out`` (see ``received_into``);
    float32 and empty for a part with no pieces."""
    arrays = pieces(part)
    recv = received_into(out, sum(a.size for a in arrays),
                         arrays[0].dtype if arrays else np.float32, what)
    if arrays:
        np.concatenate(arrays, out=recv)
    return recv


class Comm:
    """What the runtime needs from a communicator. Rank 0 is the server.

    ``is_worker`` is true on ranks 1..W, and on rank 0 when it is the only rank
    (a single process is server and worker at once).
    """

    rank: int = 0
    size: int = 1
    ledger: Ledger

    @property
    def is_server(self) -> bool:
        return self.rank == 0

    @property
    def is_worker(self) -> bool:
        return self.rank > 0 or self.size == 1

    @property
    def num_workers(self) -> int:
        return max(self.size - 1, 1)

    @property
    def worker_index(self) -> int:
        return max(self.rank - 1, 0)

    def bcast(self, buf, root: int = 0) -> None: ...
    def bcast_obj(self, obj, root: int = 0): ...
    def reduce_sum(self, sendbuf, recvbuf, root: int = 0) -> None: ...
    def allreduce_sum(self, buf) -> None: ...
    def gatherv(self, sendbuf: np.ndarray, root: int = 0,
                out: np.ndarray | None = None) -> list[np.ndarray] | None:
        """Every rank's ``sendbuf`` on the root, in rank order, as views of one array: a new
        one, or ``out`` (see ``received_into``); None elsewhere."""
        ...
    def alltoallv(self, parts: list, out: np.ndarray | None = None) -> list[np.ndarray]:
        """Every rank sends ``parts[r]`` to rank r and returns what each rank sent it, in
        rank order, one 1-D array per rank. A part is a 1-D array or a list of them
        (pieces, sent back to back without being copied into one first). Every array
        of the call, on every rank, has one dtype. What is returned is views of one
        array: a new one, or the start of ``out`` (see ``received_into``)."""
        ...
    def gather_obj(self, obj, root: int = 0, count: bool = True) -> list | None: ...
    def scatter_obj(self, objs: list | None, root: int = 0): ...
    def abort(self, code: int = 1) -> None: ...
    def hostnames(self) -> list[str]: ...
    def node_peers(self, info) -> list[tuple[int, object]]:
        """(world rank, ``info``) of every rank on this node, this one included, in rank
        order: collective over all ranks. Node = shared memory (MPI COMM_TYPE_SHARED)."""
        ...

    def node_shared(self, load):
        """``load()`` (a dataset: an object whose CPU tensor attributes are its big arrays),
        held once per node: collective over all ranks. Where the ranks of a node can share
        memory, one of them calls ``load`` and the others get the same object with those
        tensors over the same bytes (``MPIComm``); the shared tensors are read-only by
        convention: nothing may write into them in place. Here, with nothing to share
        with, every rank just loads."""
        return load()

    def release_shared(self) -> None:
        """Free what ``node_shared`` holds, once the experiment that read it has ended and
        been dropped (collective over all ranks): a process that runs one experiment after
        another (``fedmpi tune``) would otherwise keep every one's dataset. Nothing may
        read those tensors after. Here there is nothing to free."""


class Stopwatch:
    """Adds elapsed seconds to a ledger field; used around every collective."""

    def __init__(self, ledger: Ledger, field: str):
        self.ledger, self.field = ledger, field

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        setattr(self.ledger, self.field,
                getattr(self.ledger, self.field) + time.perf_counter() - self.t0)
