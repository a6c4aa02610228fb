"""Cost of EUA's Gram path (fedmpi.runtime.gram) against the plain sum FedAvg uses.

Under mpirun, K client updates of d values spread over the workers, as the runtime holds
them. Times, per round, (a) the FedAvg path: each worker sums its clients, one Reduce to
the server, into new buffers made as the runtime makes them (``flat.host_vector``);
(b) the Gram path: Alltoallv transpose, per-block Grams, coefficients on the server,
per-block weighted sums gathered to the server, its buffers kept from one repeat to
the next as a run keeps them from round to round. Prints seconds (median of
--repeat), the Gram path's over FedAvg's, and the bytes each path moved, the largest
amount any one rank received, and what gathering all K vectors on one rank would take
instead. Also the seconds of the per-block float64 products A_b A_b^T alone (all workers
at once, the slowest one's): they fix G's bits, so the Gram path costs at least that:

    mpirun -n 3 python benchmarks/gram.py                      # d = 11.2M (ResNet-18), K = 10
    mpirun -n 5 --oversubscribe python benchmarks/gram.py --clients 100 --params 1000000

(``--oversubscribe`` wherever the node has fewer cores than ranks: the figures in
docs/performance.md, "The Gram path", are ``mpirun -n 3 --oversubscribe`` on 2 cores,
``--repeat 7``.)
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedmpi.comm.mpi import MPIComm
from fedmpi.flat import host_vector
from fedmpi.runtime.gram import BLOCK, Workspace, block_ranges, owned_blocks, weighted_sum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=11_200_000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPIComm()
    d, k, workers = args.params, args.clients, comm.num_workers
    assignment = [np.arange(w, k, workers) for w in range(workers)]
    mine = [torch.randn(d, generator=torch.Generator().manual_seed(int(c)))
            for c in assignment[comm.worker_index]] if comm.is_worker else []
    results = {"fedavg": [], "gram": [], "products": []}
    blocks = block_ranges(d)
    owned = [blocks[b] for b in owned_blocks(len(blocks), comm.worker_index, workers)
             ] if comm.is_worker else []
    buffer = torch.randn(k * min(BLOCK, d), dtype=torch.float64)   # one block of K vectors
    moved = {}
    space = Workspace()   # the Gram path's buffers, kept from round to round as a run keeps them
    for _ in range(args.repeat):
        comm.ledger.take()
        start = time.perf_counter()
        total = host_vector(d)   # as the runtime's sums and total are made
        for v in mine:
            total += v
        out = host_vector(d) if comm.is_server else None
        comm.reduce_sum(total, out)
        results["fedavg"].append(time.perf_counter() - start)
        moved["fedavg"] = comm.gather_obj(comm.ledger.take(), count=False)
        start = time.perf_counter()
        weighted_sum(comm, mine, assignment, d, lambda g: np.full(len(g), 1.0 / len(g)),
                     workspace=space)
        results["gram"].append(time.perf_counter() - start)
        moved["gram"] = comm.gather_obj(comm.ledger.take(), count=False)
        comm.gather_obj(None, count=False)   # the workers start the products together
        start = time.perf_counter()
        for s, e in owned:
            a = buffer[:k * (e - s)].view(k, e - s)
            a @ a.T
        seconds = comm.gather_obj(time.perf_counter() - start, count=False)
        results["products"].append(max(seconds) if comm.is_server else 0.0)
    if comm.is_server:
        report = {"ranks": comm.size, "d": d, "clients": k}
        for path in ("fedavg", "gram"):
            ledgers = moved[path]
            report[path] = {"seconds": float(np.median(results[path])),
                            "mb_moved": sum(led.sent for led in ledgers) / 1e6,
                            "max_mb_received_by_one_rank": max(led.received for led in ledgers) / 1e6}
        report["gram_over_fedavg"] = report["gram"]["seconds"] / report["fedavg"]["seconds"]
        report["products_seconds"] = float(np.median(results["products"]))
        report["mb_to_gather_all_vectors_on_one_rank"] = k * d * 4 / 1e6
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
