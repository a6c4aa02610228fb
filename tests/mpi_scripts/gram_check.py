"""Run under mpirun: fedmpi.runtime.gram against a single-process computation of the same
vectors (bitwise) and against float64 numpy (closed form), with blocks of 7 coordinates;
d = 53 (8 blocks) unless argv[1] gives another (20: 3 blocks, fewer than 4 workers), and
5 clients unless argv[2] gives fewer (2: workers without clients)."""

import json
import sys

import numpy as np
import torch

from fedmpi.comm import LocalComm
from fedmpi.comm.mpi import MPIComm
from fedmpi.runtime.gram import weighted_sum

D, BLOCK = int(sys.argv[1]) if len(sys.argv) > 1 else 53, 7
CLIENTS = [4, 0, 9, 2, 7][:int(sys.argv[2]) if len(sys.argv) > 2 else 5]   # ids, not positions
vectors = {c: torch.randn(D, generator=torch.Generator().manual_seed(c)) for c in CLIENTS}


def coefficients(gram):
    return np.arange(1, len(gram) + 1) / np.sqrt(np.diag(gram))


comm = MPIComm()
workers = comm.num_workers
assignment = [np.array(CLIENTS[w::workers]) for w in range(workers)]   # uneven on purpose
mine = [vectors[c] for c in assignment[comm.worker_index]] if comm.is_worker else []
seen = {}


def record(gram):
    seen["gram"] = gram
    return coefficients(gram)


total, coef = weighted_sum(comm, mine, assignment, D, record, block=BLOCK)
report = None
if comm.is_server:
    local_seen = {}
    ref, ref_coef = weighted_sum(LocalComm(), [vectors[c] for c in CLIENTS], [np.array(CLIENTS)], D,
                                 lambda g: local_seen.setdefault("gram", g) is g and coefficients(g),
                                 block=BLOCK)
    a = np.stack([vectors[c].double().numpy() for c in sorted(CLIENTS)])
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
    report["all_vectors_bytes"] = 4 * D * len(CLIENTS)
    print(json.dumps(report))
sys.exit(0)
