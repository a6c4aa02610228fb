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
"""

from __future__ import annotations

import io
import pickle
import socket
import time

import numpy as np
import torch

from .base import Comm, Ledger, Stopwatch, as_array


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
        from mpi4py import MPI  # imported here so single-process runs never load MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.ledger = Ledger()
        self.max_sleep = max_sleep

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

    def gatherv(self, sendbuf, root=0):
        send = np.ascontiguousarray(as_array(sendbuf))
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            counts = self.comm.gather(send.size, root=root)
            recv = None
            if self.rank == root:
                recv = np.empty(sum(counts), dtype=send.dtype)
                self.comm.Gatherv(send, (recv, counts), root=root)
            else:
                self.comm.Gatherv(send, None, root=root)
        if self.rank != root:
            self.ledger.sent += send.nbytes
            return None
        self.ledger.received += (recv.size - send.size) * send.itemsize
        return np.split(recv, np.cumsum(counts)[:-1])

    def alltoallv(self, parts):
        send = [np.ascontiguousarray(as_array(p)).reshape(-1) for p in parts]
        if len(send) != self.size:
            raise ValueError(f"alltoallv needs {self.size} parts, got {len(send)}")
        dtype = send[self.rank].dtype
        counts = np.array([p.size for p in send], dtype=np.int64)
        self._arrive()
        with Stopwatch(self.ledger, "comm_seconds"):
            rcounts = np.array(self.comm.alltoall(counts.tolist()), dtype=np.int64)
            sbuf = np.concatenate(send).astype(dtype, copy=False) if send else np.zeros(0, dtype)
            rbuf = np.empty(int(rcounts.sum()), dtype=dtype)
            sdispl = np.concatenate([[0], np.cumsum(counts)[:-1]])
            rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]])
            self.comm.Alltoallv([sbuf, (counts, sdispl)], [rbuf, (rcounts, rdispl)])
        itemsize = np.dtype(dtype).itemsize
        self.ledger.sent += int(counts.sum() - counts[self.rank]) * itemsize
        self.ledger.received += int(rcounts.sum() - rcounts[self.rank]) * itemsize
        return np.split(rbuf, np.cumsum(rcounts)[:-1])

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
        self.comm.Abort(code)

    def hostnames(self):
        return self.comm.allgather(socket.gethostname())

    def node_peers(self, info):
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return sorted(node.allgather((self.rank, info)), key=lambda pair: pair[0])
        finally:
            node.Free()
