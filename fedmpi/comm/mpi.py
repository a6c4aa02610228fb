"""The MPI backend (mpi4py), with the byte ledger and a waiting rule that frees the core.

OpenMPI busy-polls inside blocking calls: a server blocked in a Reduce while the
workers train burns most of a core, which on a small or oversubscribed node slows
the very workers it waits for. So every collective first waits for all ranks to arrive
on a non-blocking barrier, testing it with a sleep that backs off to ``max_sleep``,
and only then runs the (now fast) blocking collective. The first wait is idle time,
the second is communication time; both are recorded per rank.

The sleep grows with the time already waited (2% of it, between 10 us and
``max_sleep`` = 5 ms): a collective whose ranks are all there is entered within
microseconds, while a server waiting a second for its workers wakes ~200 times (about
0.3% of a core) and notices their arrival within 5 ms. (A 20 ms cap measured ~20 ms of
added latency per round on the benchmark workload.)

The dataset is held once per node (``node_shared``): the node's lowest rank loads it into
an MPI shared-memory window and the node's other ranks map the same bytes, so nine ranks
on a node do not hold nine training sets. ``FEDMPI_NODE_SHARED=0`` turns this off (every
rank loads its own copy, as before); so does any failure to set the window up.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import socket
import time

import numpy as np
import torch

from ..errors import flush_streams
from .base import Comm, Ledger, Stopwatch, as_array, pieces, received_into

PIECE_TAG = 17   # alltoallv's messages: one tag, matched in the order they were posted
FORWARD_SECONDS = 1.0   # abort: mpirun's time to pass on the rank's last lines (below errors.ALONE_AFTER)


class _HostPickler(pickle.Pickler):
    """Refuses torch tensors: a pickled CUDA tensor is unpickled onto the GPU it came from,
    which the receiving rank may not have (or must not touch: the server). CPU tensors
    are refused too, so that code which would send a GPU tensor on a GPU node already
    fails in the CPU-only tests under mpirun."""

    def __init__(self, file, what: str):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.what = what

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            raise TypeError(f"comm.{self.what}: got a torch tensor (device {obj.device}, shape "
                            f"{tuple(obj.shape)}); objects sent between ranks must be host data: "
                            f"send tensor.detach().cpu().numpy()")
        return NotImplemented


def host_pickle(obj, what: str) -> bytes:
    buffer = io.BytesIO()
    _HostPickler(buffer, what).dump(obj)
    return buffer.getvalue()


class MPIComm(Comm):
    def __init__(self, comm=None, max_sleep: float = 0.005):
        # Open MPI queries every one-sided (osc) component when a window is made, and its
        # UCX one prints an error on a node without UCX transports although the window
        # (shared memory: UCX cannot make those anyway) is then made by another. Read at
        # MPI_Init, so set before the import; a value the user set is kept.
        os.environ.setdefault("OMPI_MCA_osc", "^ucx")
        from mpi4py import MPI  # imported here so single-process runs never load MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.ledger = Ledger()
        self.max_sleep = max_sleep
        self.node_windows = []   # (node communicator, window) behind shared tensors: kept
                                 # until MPI_Finalize or release_shared frees them

    def _arrive(self) -> None:
        """Wait for every rank without spinning: Ibarrier + Test with backoff sleep."""
        with Stopwatch(self.ledger, "idle_seconds"):
            request = self.comm.Ibarrier()
            start = time.perf_counter()
            while not request.Test():
                waited = time.perf_counter() - start
                time.sleep(min(max(1e-5, 0.02 * waited), self.max_sleep))
        self.ledger.calls += 1

    def _count(self, nbytes: int, root: int, to_root: bool) -> None:
        others = self.size - 1
        if self.rank == root:
            if to_root:
                self.ledger.received += nbytes * others
            else:
                self.ledger.sent += nbytes * others
        elif to_root:
            self.ledger.sent += nbytes
        else:
            self.ledger.received += nbytes

    def bcast(self, buf, root=0):
        array = as_array(buf)
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            self.comm.Bcast(array, root=root)
        self._count(array.nbytes, root, to_root=False)

    def bcast_obj(self, obj, root=0):
        data = host_pickle(obj, "bcast_obj") if self.rank == root else None
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            data = self.comm.bcast(data, root=root)
        self._count(len(data), root, to_root=False)
        return pickle.loads(data)

    def reduce_sum(self, sendbuf, recvbuf, root=0):
        send = as_array(sendbuf)
        recv = as_array(recvbuf) if self.rank == root else None
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            self.comm.Reduce(send, recv, op=self.MPI.SUM, root=root)
        self._count(send.nbytes, root, to_root=True)

    def allreduce_sum(self, buf):
        array = as_array(buf)
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)
        self.ledger.sent += array.nbytes
        self.ledger.received += array.nbytes

    def gatherv(self, sendbuf, root=0, out=None):
        send = np.ascontiguousarray(as_array(sendbuf))
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            counts = self.comm.gather(send.size, root=root)
            recv = None
            if self.rank == root:
                recv = received_into(out, sum(counts), send.dtype, "gatherv")
                self.comm.Gatherv(send, (recv, counts), root=root)
            else:
                self.comm.Gatherv(send, None, root=root)
        if self.rank != root:
            self.ledger.sent += send.nbytes
            return None
        self.ledger.received += (recv.size - send.size) * send.itemsize
        return np.split(recv, np.cumsum(counts)[:-1])

    def alltoallv(self, parts, out=None):
        """Point to point, a message a piece, each received where it belongs in one
        buffer: no piece is copied into a send buffer first, and each is one contiguous
        message, which Open MPI moves with a single copy between ranks of a node. (An
        Alltoallv of the same bytes, from one packed buffer, measured twice as slow under
        ``mpirun -n 3`` on a 2-core node: 38 against 19 ms for 112 MB a worker.)"""
        if len(parts) != self.size:
            raise ValueError(f"alltoallv needs {self.size} parts, got {len(parts)}")
        send = [[np.ascontiguousarray(p) for p in pieces(part)] for part in parts]
        send_any = [p for part in send for p in part]
        dtypes = {p.dtype for p in send_any}
        if len(dtypes) > 1:
            raise ValueError(f"alltoallv sends one dtype, got {sorted(map(str, dtypes))}")
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            # every rank learns the dtype and piece sizes each other rank sends it
            got = self.comm.alltoall([(part[0].dtype.str, [p.size for p in part])
                                      if part else ("<f4", []) for part in send])
            kinds = [kind for kind, sizes in got if sizes] + [p.dtype for p in send_any]
            dtype = np.dtype(kinds[0] if kinds else np.float32)
            counts = [sum(sizes) for _, sizes in got]
            received = np.split(received_into(out, sum(counts), dtype, "alltoallv"),
                                np.cumsum(counts)[:-1])
            requests = []
            for source, (_, sizes) in enumerate(got):
                ends = np.cumsum(sizes).tolist()
                for i, (end, size) in enumerate(zip(ends, sizes)):
                    piece = received[source][end - size:end]
                    if source == self.rank:
                        np.copyto(piece, send[source][i])
                    else:
                        requests.append(self.comm.Irecv(piece, source=source, tag=PIECE_TAG))
            for dest, part in enumerate(send):
                if dest != self.rank:
                    requests += [self.comm.Isend(p, dest=dest, tag=PIECE_TAG) for p in part]
            self.MPI.Request.Waitall(requests)
        itemsize = dtype.itemsize
        self.ledger.sent += (sum(p.size for p in send_any)
                             - sum(p.size for p in send[self.rank])) * itemsize
        self.ledger.received += (sum(counts) - counts[self.rank]) * itemsize
        return received

    def gather_obj(self, obj, root=0, count=True):
        data = host_pickle(obj, "gather_obj")
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            parts = self.comm.gather(data, root=root)
        if count:
            self._count_parts(len(data), parts, root)
        return None if parts is None else [pickle.loads(p) for p in parts]

    def scatter_obj(self, objs, root=0):
        parts = None
        if self.rank == root:
            parts = [host_pickle(o, "scatter_obj") for o in objs]
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            data = self.comm.scatter(parts, root=root)
        if self.rank == root:
            self.ledger.sent += sum(len(p) for p in parts) - len(data)
        else:
            self.ledger.received += len(data)
        return pickle.loads(data)

    def _count_parts(self, own: int, parts, root: int) -> None:
        if self.rank == root:
            self.ledger.received += sum(len(p) for p in parts) - own
        else:
            self.ledger.sent += own

    def abort(self, code=1):
        """End the whole job with ``code``, after a moment that lets mpirun pass on what
        this rank just wrote. mpirun forwards a rank's output on its own time: on a loaded
        node the abort's banner came first and the rank's line after it, or never (the
        launcher gone before it read the pipe). The pause costs a failing job one second."""
        flush_streams()
        time.sleep(FORWARD_SECONDS)
        self.comm.Abort(code)

    def hostnames(self):
        return self.comm.allgather(socket.gethostname())

    def node_peers(self, info):
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return sorted(node.allgather((self.rank, info)), key=lambda pair: pair[0])
        finally:
            node.Free()

    def release_shared(self):
        for node, window in self.node_windows:
            window.Free()
            node.Free()
        self.node_windows = []

    def node_shared(self, load):
        """``load()``'s object, its CPU tensor attributes in one shared-memory window per
        node: the node's lowest rank loads (only it reads the files), copies the tensors
        into the window and broadcasts the object without them to the node's other ranks,
        which attach tensors over the same bytes (``torch.from_numpy``, no copy). Nothing
        here goes through the ledger: it counts the federation's traffic, and this is the
        node's setup (the same results, bytes included, with sharing on or off).

        Falls back to every rank calling ``load`` with no error when sharing is off
        (FEDMPI_NODE_SHARED=0), pointless (one rank on the node), not possible for the
        object (no tensor attributes, a dtype numpy lacks) or not available from MPI (a
        window cannot be allocated, e.g. ``OMPI_MCA_osc=^sm``). If the leader's ``load``
        raises, the others call ``load`` too, so every rank reports its own error as
        without sharing."""
        if os.environ.get("FEDMPI_NODE_SHARED", "1").strip() == "0":
            return load()
        try:
            node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        except self.MPI.Exception:
            return load()
        if node.Get_size() == 1:
            node.Free()
            return load()
        leader = node.Get_rank() == 0
        obj = plan = None
        if leader:
            try:
                obj = load()
            except BaseException:
                node.bcast(None, root=0)   # release the others: they load (and fail) too
                node.Free()
                raise
            plan = _share_plan(obj)
            node.bcast(plan, root=0)
        else:
            plan = node.bcast(None, root=0)
        if plan is None:
            node.Free()
            return obj if leader else load()
        pickled, layout, nbytes = plan
        window = self._allocate_shared(nbytes if leader else 0, node)
        if not node.allreduce(window is not None, op=self.MPI.LAND):
            # a window some ranks got is left to MPI_Finalize: freeing it is collective
            # over ranks that have none
            return obj if leader else load()
        buffer, _ = window.Shared_query(0)
        memory = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
        target = obj if leader else pickle.loads(pickled)
        window.Lock_all(self.MPI.MODE_NOCHECK)   # MPI's pattern for loads and stores
        for name, dtype, shape, offset in layout:
            array = memory[offset:offset + int(np.prod(shape)) * np.dtype(dtype).itemsize]
            array = array.view(dtype).reshape(shape)
            if leader:
                np.copyto(array, getattr(obj, name).detach().numpy())
            vars(target)[name] = torch.from_numpy(array)
        window.Sync()      # the leader's stores are complete and visible ...
        node.Barrier()
        window.Sync()      # ... before any other rank reads
        window.Unlock_all()
        self.node_windows.append((node, window))
        return target

    def _allocate_shared(self, nbytes: int, node):
        """An MPI shared-memory window of ``nbytes`` on this rank, or None where MPI has
        none to give (collective over ``node``)."""
        try:
            return self.MPI.Win.Allocate_shared(nbytes, 1, comm=node)
        except self.MPI.Exception:
            return None


_ALIGN = 64   # each array starts on a cache line


def _share_plan(obj):
    """(``obj`` without its CPU tensors, pickled; [(attribute, numpy dtype, shape, byte
    offset)]; total bytes) for its CPU tensor attributes, or None where there is nothing
    to share, the rest does not pickle, or the tensors are files every rank maps itself
    (``mapped_from``, fedmpi.data.cache: the page cache is the node's one copy)."""
    try:
        attributes = vars(obj)
    except TypeError:   # __slots__: no attribute dict to strip and refill
        return None
    if attributes.get("mapped_from"):
        return None
    tensors = {name: value for name, value in attributes.items()
               if isinstance(value, torch.Tensor) and value.device.type == "cpu"}
    layout, offset = [], 0
    for name, tensor in tensors.items():
        try:
            dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        except (TypeError, RuntimeError):   # a dtype numpy lacks (bfloat16)
            return None
        layout.append((name, dtype.str, tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * dtype.itemsize // _ALIGN) * _ALIGN
    if not layout or offset == 0:
        return None
    try:
        stripped = copy.copy(obj)
        for name in tensors:
            vars(stripped)[name] = None
        pickled = pickle.dumps(stripped, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:   # noqa: BLE001 - whatever a plugin's object holds: load per rank
        return None
    return pickled, layout, offset
