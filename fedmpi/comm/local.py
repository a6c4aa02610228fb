"""The single-process backend: rank 0 is server and worker, collectives are identities."""

from __future__ import annotations

import socket
import sys

import numpy as np

from .base import Comm, Ledger, as_array, joined


class LocalComm(Comm):
    """One process, no MPI: nothing is moved, so nothing is counted."""

    def __init__(self):
        self.rank, self.size, self.ledger = 0, 1, Ledger()

    def bcast(self, buf, root=0):
        pass

    def bcast_obj(self, obj, root=0):
        return obj

    def reduce_sum(self, sendbuf, recvbuf, root=0):
        np.copyto(as_array(recvbuf), as_array(sendbuf))

    def allreduce_sum(self, buf):
        pass

    def gatherv(self, sendbuf, root=0, out=None):
        return [joined(sendbuf, out, "gatherv")]

    def alltoallv(self, parts, out=None):
        return [joined(parts[0], out, "alltoallv")]

    def gather_obj(self, obj, root=0, count=True):
        return [obj]

    def scatter_obj(self, objs, root=0):
        return objs[0]

    def abort(self, code=1):
        sys.exit(code)

    def hostnames(self):
        return [socket.gethostname()]

    def node_peers(self, info):
        return [(0, info)]
