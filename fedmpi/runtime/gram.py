"""Inner products and weighted sums of per-client vectors, computed where the vectors are.

FedU^2's EUA weighs each client's update by a function of every
pair: it needs G_kl = <Delta_k, Delta_l> over the K participants, then sum_k c_k Delta_k.
Shipping every Delta_k to the server would put K d values on one rank. Instead the d
coordinates are cut into fixed blocks of ``BLOCK`` values and block b belongs to worker
b mod W:

1. transpose (one Alltoallv): each worker sends every other worker the slices of its
   clients' vectors in the blocks that worker owns (its own blocks' slices stay where
   they are). A worker then holds its blocks of all K vectors, about K d / W values;
   each value crosses the network once.
2. Gram: each worker computes A_b A_b^T (float64) of each of its blocks and sends the
   K x K partials to the server, which adds them in block order.
3. The server turns G into coefficients c (the algorithm's rule) and broadcasts K values.
4. Combine: each worker computes sum_k c_k A_b[k] for its blocks (float64, clients in
   ascending id); the server gathers the blocks, d values in total, as a Reduce would.

A_b (float64 [K, width], clients in ascending id) is written, from what was received and
from the worker's own vectors, into one buffer reused for every block, once for step 2
and once for step 4: the K d / W values are never held in float64, and the products
always see one layout, a contiguous array at the start of a torch allocation (as a fresh
``.double()`` copy of the block would be: a BLAS's summation order may depend on alignment).
Blocks and every summation order depend on d and the client ids alone, so G and the sum
are the same bits for any number of workers (deterministic mode runs one thread per
rank, so each block's product runs the same kernel). The products are most of the cost
(``benchmarks/gram.py``; d = 11.2M, K = 10, a 2-core AVX-512 CPU): under ``mpirun -n 3``
the path takes 1.93-2.08x a FedAvg reduce (2.13-2.15x when the transpose was packed
twice), the products alone 0.7x; with one worker (``-n 2``) 3.7-3.9x, the products
alone 2.1x.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

BLOCK = 1 << 16  # coordinates per block: the unit of ownership and of float summation


def block_ranges(d: int, block: int = BLOCK) -> list[tuple[int, int]]:
    return [(start, min(start + block, d)) for start in range(0, d, block)]


def _rank_of(worker: int, comm) -> int:
    return worker + (1 if comm.size > 1 else 0)


def _owned(num_blocks: int, worker: int, num_workers: int) -> list[int]:
    return list(range(worker, num_blocks, num_workers))


def _transpose_parts(comm, local: list[np.ndarray], blocks) -> list[np.ndarray]:
    """What this worker sends each rank in step 1: its clients' slices of that worker's
    blocks, block by block (its clients in order within a block), packed back to back
    in one array in rank order, so the Alltoallv sends them from where they are."""
    workers, me = comm.num_workers, comm.worker_index
    spans = [[blocks[b] for b in _owned(len(blocks), w, workers)]
             if comm.is_worker and local and w != me else [] for w in range(workers)]
    buffer = np.empty(len(local) * sum(e - s for w in spans for s, e in w), np.float32)
    parts, at = [buffer[:0] for _ in range(comm.size)], 0
    for w, owned in enumerate(spans):
        start = at
        for s, e in owned:
            for v in local:
                buffer[at:at + e - s] = v[s:e]
                at += e - s
        parts[_rank_of(w, comm)] = buffer[start:at]
    return parts


def weighted_sum(comm, vectors: list[torch.Tensor], assignment, d: int,
                 coefficients: Callable[[np.ndarray], np.ndarray],
                 block: int = BLOCK) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """sum_k c_k v_k on the server, with c = coefficients(G) computed there from the Gram
    matrix G (float64, K x K, clients in ascending id) of every participant's vector.

    Every rank calls this. ``vectors`` are this worker's clients' vectors (length d) in
    the order of ``assignment[worker_index]``. Returns (sum as float32 [d], c) on the
    server and (None, None) elsewhere.
    """
    blocks = block_ranges(d, block)
    workers = comm.num_workers
    order = np.sort(np.concatenate([np.asarray(a, dtype=np.int64) for a in assignment]))
    position = {int(c): i for i, c in enumerate(order)}
    k = len(order)
    me = comm.worker_index
    mine = _owned(len(blocks), me, workers) if comm.is_worker else []
    # the rows (positions among the K, ascending id) of each worker's clients, in its order
    rows_of = [np.array([position[int(c)] for c in np.asarray(a).tolist()], dtype=np.int64)
               for a in assignment]

    # 1. transpose: my slices of every other worker's blocks, to that worker, block by
    #    block (my clients in order within a block); slices of my own blocks stay in place
    local = [v.detach().reshape(-1).float().cpu().numpy() for v in vectors]
    received = comm.alltoallv(_transpose_parts(comm, local, blocks))
    # my i-th block spans starts[i]:starts[i + 1] of what each worker sent me
    starts = np.cumsum([0] + [blocks[b][1] - blocks[b][0] for b in mine])
    # one float64 buffer, reused for every block: each block of the K vectors is converted
    # where it is used (Gram, then weighted sum), with no allocation per block
    buffer = torch.empty(k * min(block, d) if mine else 0, dtype=torch.float64)

    def rows(i: int) -> torch.Tensor:
        """My i-th block of the K vectors: float64 [K, width], clients in ascending id."""
        s, e = blocks[mine[i]]
        width = e - s
        a = buffer[:k * width].view(k, width)
        target = a.numpy()
        for w in range(workers):
            if w == me:
                for row, v in zip(rows_of[w].tolist(), local):
                    target[row] = v[s:e]
            elif len(rows_of[w]):
                n = len(rows_of[w])
                data = received[_rank_of(w, comm)]
                target[rows_of[w]] = data[n * starts[i]:n * starts[i + 1]].reshape(n, width)
        return a

    # 2. Gram partials (torch's kernel, at the run's thread count), added in block order
    partials = np.zeros((len(mine), k, k))
    for i in range(len(mine)):
        a = rows(i)
        partials[i] = (a @ a.T).numpy()
    gathered = comm.gatherv(partials.reshape(-1))
    coef = np.zeros(k)
    if comm.is_server:
        by_block = {}
        for w in range(workers):
            got = gathered[_rank_of(w, comm)].reshape(-1, k, k)
            by_block.update(zip(_owned(len(blocks), w, workers), got))
        gram = np.zeros((k, k))
        for b in range(len(blocks)):
            gram += by_block[b]
        coef = np.asarray(coefficients(gram), dtype=np.float64).reshape(k)

    # 3. coefficients to the workers; 4. each block's weighted sum, gathered to the server
    comm.bcast(coef)
    weights = torch.from_numpy(coef)
    # one float64 product per block: a fixed shape, so the same kernel for any layout
    sums = np.empty(int(starts[-1]), np.float32)
    for i in range(len(mine)):
        sums[starts[i]:starts[i + 1]] = (weights @ rows(i)).float().numpy()
    gathered = comm.gatherv(sums)
    if not comm.is_server:
        return None, None
    out = np.empty(d, np.float32)   # numpy's allocation: huge pages where the kernel allows
    for w in range(workers):
        data, offset = gathered[_rank_of(w, comm)], 0
        for b in _owned(len(blocks), w, workers):
            s, e = blocks[b]
            out[s:e] = data[offset:offset + e - s]
            offset += e - s
    return torch.from_numpy(out), coef
