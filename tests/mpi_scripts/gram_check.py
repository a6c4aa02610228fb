"""Run under mpirun: fedmpi.runtime.gram against a single-process computation of the same
vectors (bitwise) and against float64 numpy (closed form), with blocks of 7 coordinates,
for each case D:K in argv (one MPI launch, several cases: each launch costs every rank's
imports): d = D coordinates (53: 8 blocks; 20: 3 blocks, fewer than 4 workers) and the
first K of 5 clients (2: workers without clients). Prints one JSON report per case."""

import json
import sys

import numpy as np
import torch

from fedmpi.comm import LocalComm
from fedmpi.comm.mpi import MPIComm
from fedmpi.runtime.gram import Workspace, weighted_sum

BLOCK = 7


def coefficients(gram):
    return np.arange(1, len(gram) + 1) / np.sqrt(np.diag(gram))


def check(comm, d: int, k: int, space: Workspace) -> dict | None:
    """One case, with this rank's buffers kept from the cases before; the server's
    report (None on the workers)."""
    clients = [4, 0, 9, 2, 7][:k]   # ids, not positions
    vectors = {c: torch.randn(d, generator=torch.Generator().manual_seed(c)) for c in clients}
    workers = comm.num_workers
    assignment = [np.array(clients[w::workers]) for w in range(workers)]   # uneven on purpose
    mine = [vectors[c] for c in assignment[comm.worker_index]] if comm.is_worker else []
    seen = {}

    def record(gram):
        seen["gram"] = gram
        return coefficients(gram)

    total, coef = weighted_sum(comm, mine, assignment, d, record, block=BLOCK, workspace=space)
    report = None
    if comm.is_server:
        local_seen = {}
        ref, ref_coef = weighted_sum(LocalComm(), [vectors[c] for c in clients], [np.array(clients)], d,
                                     lambda g: local_seen.setdefault("gram", g) is g and coefficients(g),
                                     block=BLOCK)
        a = np.stack([vectors[c].double().numpy() for c in sorted(clients)])
        exact_sum = coefficients(a @ a.T) @ a
        report = {
            "gram_bitwise": bool(np.array_equal(seen["gram"], local_seen["gram"])),
            "sum_bitwise": bool(torch.equal(total, ref)),
            "gram_close": bool(np.allclose(seen["gram"], a @ a.T, rtol=1e-12, atol=1e-12)),
            "sum_close": bool(np.allclose(total.numpy(), exact_sum, rtol=1e-6, atol=1e-6)),
            "coef_close": bool(np.allclose(coef, coefficients(a @ a.T), rtol=1e-12)),
        }
    led = comm.ledger.take()
    sizes = comm.gather_obj(led.received, count=False)
    if comm.is_server:
        # no rank receives all K d values: the server gets d floats of sums plus small Grams
        report["max_worker_received"] = max(sizes[1:])
        report["all_vectors_bytes"] = 4 * d * len(clients)
    return report


comm = MPIComm()
space = Workspace()
reports = {case: check(comm, *map(int, case.split(":")), space) for case in sys.argv[1:]}
if comm.is_server:
    print(json.dumps(reports))
sys.exit(0)
