"""Inner products and weighted sums of per-client vectors, computed where the vectors are.

FedU^2's EUA weighs each client's update by a function of every
pair: it needs G_kl = <Delta_k, Delta_l> over the K participants, then sum_k c_k Delta_k.
Shipping every Delta_k to the server would put K d values on one rank. Instead the d
coordinates are cut into fixed blocks of ``BLOCK`` values and block b belongs to worker
b mod W:

1. transpose (one Alltoallv): each worker sends every other worker the slices of its
   clients' vectors in the blocks that worker owns. A worker then holds its blocks of
   all K vectors, about K d / W values; each value crosses the network once.
2. Gram: each worker computes A_b A_b^T (float64) of each of its blocks and sends the
   K x K partials to the server, which adds them in block order.
3. The server turns G into coefficients c (the algorithm's rule) and broadcasts K values.
4. Combine: each worker computes sum_k c_k A_b[k] for its blocks (float64, clients in
   ascending id); the server gathers the blocks, d values in total, as a Reduce would.

Blocks and every summation order depend on d and the client ids alone, so G and the sum
are the same bits for any number of workers (deterministic mode runs one thread per
rank, so each block's product runs the same kernel).
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
    mine = _owned(len(blocks), comm.worker_index, workers) if comm.is_worker else []

    # 1. transpose: my slices of every block, to the block's owner
    stacked = torch.stack([v.detach().reshape(-1).float().cpu() for v in vectors]) \
        if vectors else torch.zeros(0, d)
    parts = [np.zeros(0, np.float32) for _ in range(comm.size)]
    if comm.is_worker:
        for w in range(workers):
            spans = [blocks[b] for b in _owned(len(blocks), w, workers)]
            pieces = [stacked[:, s:e].reshape(-1) for s, e in spans]
            parts[_rank_of(w, comm)] = torch.cat(pieces).numpy() if pieces else np.zeros(0, np.float32)
    received = comm.alltoallv(parts)
    owned = {b: np.zeros((k, blocks[b][1] - blocks[b][0]), np.float32) for b in mine}
    if comm.is_worker:
        for w in range(workers):
            clients = [position[int(c)] for c in np.asarray(assignment[w]).tolist()]
            data, offset = received[_rank_of(w, comm)], 0
            for b in mine:
                width = blocks[b][1] - blocks[b][0]
                chunk = data[offset:offset + len(clients) * width].reshape(len(clients), width)
                owned[b][clients] = chunk
                offset += chunk.size

    # 2. Gram partials (torch's kernel, at the run's thread count), added in block order
    partials = np.concatenate([_gram(owned[b]).reshape(-1) for b in mine]) if mine else np.zeros(0)
    gathered = comm.gatherv(partials)
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
    sums = [(weights @ torch.from_numpy(owned[b]).double()).float().numpy() for b in mine]
    gathered = comm.gatherv(np.concatenate(sums) if sums else np.zeros(0, np.float32))
    if not comm.is_server:
        return None, None
    out = torch.zeros(d)
    for w in range(workers):
        data, offset = gathered[_rank_of(w, comm)], 0
        for b in _owned(len(blocks), w, workers):
            s, e = blocks[b]
            out[s:e] = torch.from_numpy(data[offset:offset + e - s])
            offset += e - s
    return out, coef


def _gram(rows: np.ndarray) -> np.ndarray:
    a = torch.from_numpy(rows).double()
    return (a @ a.T).numpy()
