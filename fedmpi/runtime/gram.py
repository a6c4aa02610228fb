"""Inner products and weighted sums of per-client vectors, computed where the vectors are.

FedU^2's EUA weighs each client's update by a function of every
pair: it needs G_kl = <Delta_k, Delta_l> over the K participants, then sum_k c_k Delta_k.
Shipping every Delta_k to the server would put K d values on one rank. Instead the d
coordinates are cut into fixed blocks of ``BLOCK`` values, and each worker owns a
contiguous run of them, the runs in worker order (``owned_blocks``):

1. transpose: each worker sends every other worker its clients' slices of that worker's
   run, one contiguous slice a client, each a message sent from where it is in the
   client's vector (``alltoallv`` in pieces: nothing is packed first); slices of its own
   run stay where they are. A worker then holds its run of all K vectors, about K d / W
   values; each value crosses the network once.
2. Gram: each worker computes A_b A_b^T (float64) of each of its blocks and sends the
   K x K partials to the server, which adds them in block order.
3. The server turns G into coefficients c (the algorithm's rule) and broadcasts K values.
4. Combine: each worker computes sum_k c_k A_b[k] for its blocks (float64, clients in
   ascending id); the server gathers the runs, which in worker order are the d values in
   order, as a Reduce would.

A_b (float64 [K, width], clients in ascending id) is written, from what was received and
from the worker's own vectors, into one buffer reused for every block, once for step 2
and once for step 4: the K d / W values are never held in float64, and the products
always see one layout, a contiguous array at the start of a torch allocation (as a fresh
``.double()`` copy of the block would be: a BLAS's summation order may depend on alignment).
That buffer, the transpose's receive buffer and the worker's sums are kept from round to
round (``Workspace``, held by the run): about K d / W float32 values a worker, which fresh
buffers would fault in page by page every round. The server receives the sums straight
into the result.
Blocks and every summation order depend on d and the client ids alone, so G and the sum
are the same bits for any number of workers (deterministic mode runs one thread per
rank, so each block's product runs the same kernel).

Cost: about 2-3x a FedAvg Reduce of the same vectors on 2-core machines (d = 11.2M,
K = 10); the figures, and what was tried, are in docs/performance.md ("The Gram path";
``benchmarks/gram.py`` measures it).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..flat import host_vector

BLOCK = 1 << 16  # coordinates per block: the unit of ownership and of float summation


def block_ranges(d: int, block: int = BLOCK) -> list[tuple[int, int]]:
    return [(start, min(start + block, d)) for start in range(0, d, block)]


def _rank_of(worker: int, comm) -> int:
    return worker + (1 if comm.size > 1 else 0)


def owned_blocks(num_blocks: int, worker: int, num_workers: int) -> range:
    """The blocks a worker owns: a contiguous run, the workers' runs in worker order."""
    return range(worker * num_blocks // num_workers, (worker + 1) * num_blocks // num_workers)


def _span(blocks, owned: range) -> tuple[int, int]:
    """The coordinates [start, end) of a run of blocks (empty where it has none)."""
    return (blocks[owned[0]][0], blocks[owned[-1]][1]) if len(owned) else (0, 0)


class Workspace:
    """The buffers of ``weighted_sum`` a rank keeps from one call (round) to the next: the
    transpose's receive buffer (the other workers' clients' slices of this worker's run,
    about K d / W float32 values), this worker's sums (d / W float32) and the float64
    block. Fresh ones would be faulted in page by page on every call: at d = 11.2M,
    K = 10 and two workers that cost more than the transpose's copies did. Each buffer
    grows to the largest call's need and stays that size."""

    def __init__(self):
        self.kept: dict[str, np.ndarray | torch.Tensor] = {}

    def array(self, name: str, size: int) -> np.ndarray:
        """The first ``size`` values of float32 buffer ``name`` (contents left over), made
        by ``host_vector`` (huge pages: a fresh torch tensor of the same size, faulted in,
        took 2.7x as long)."""
        return self._grown(name, size, lambda n: host_vector(n, zeros=False).numpy())

    def block(self, size: int, pinned: bool = False) -> torch.Tensor:
        """The first ``size`` values of the float64 block buffer: always the start of a
        torch allocation, so the products see one alignment (page-locked where the
        blocks are copied to a GPU)."""
        return self._grown("block", size, lambda n: torch.empty(n, dtype=torch.float64,
                                                                pin_memory=pinned))

    def _grown(self, name: str, size: int, make):
        kept = self.kept.get(name)
        if kept is None or len(kept) < size:
            kept = self.kept[name] = make(size)
        return kept[:size]


def weighted_sum(comm, vectors: list[torch.Tensor], assignment, d: int,
                 coefficients: Callable[[np.ndarray], np.ndarray] | None,
                 block: int = BLOCK, workspace: Workspace | None = None,
                 per_block: Callable | None = None, cohort=None,
                 extra: torch.Tensor | None = None, device: torch.device | None = None
                 ) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """sum_k c_k v_k on the server, with c = coefficients(G) computed there from the Gram
    matrix G (float64, K x K, clients in ascending id) of every participant's vector; or,
    with ``per_block`` (a coordinate-wise rule: (float64 [K, width], c or None) -> (values
    [width], each row's weight summed over the block [K])), that rule's values block by
    block, given c where ``coefficients`` is given too (Bulyan's selection), else without
    a Gram matrix.

    ``cohort`` (fedmpi.runtime.omniscient): rewrites some rows of every block from the
    others' statistics before anything reads them (colluding attackers); where it needs
    global statistics it gets them first from one more pass over the blocks.

    ``extra`` (a float32 vector of length d that every worker holds: centred clipping's
    centre) joins the K vectors as row K of every block, so the Gram matrix is (K + 1) x
    (K + 1) and the coefficients K + 1; the weights returned are the K participants'.

    ``device`` (None: the CPU): where each block's Gram product and rule run, the block
    built on the host (pinned for a GPU) and copied there; the results come back as
    float64 K x K partials and d / W float32 values, as from the CPU.

    Every rank calls this. ``vectors`` are this worker's clients' vectors (length d) in
    the order of ``assignment[worker_index]``. ``workspace``: this rank's buffers, kept
    across calls (None: new ones for this call). Returns, on the server, the sum as
    float32 [d] and each participant's weight in it (ascending id: c, or a coordinate
    rule's weights averaged over the d coordinates); (None, None) elsewhere.
    """
    space = workspace if workspace is not None else Workspace()
    blocks = block_ranges(d, block)
    workers = comm.num_workers
    order = np.sort(np.concatenate([np.asarray(a, dtype=np.int64) for a in assignment]))
    position = {int(c): i for i, c in enumerate(order)}
    k = len(order)
    me = comm.worker_index
    mine = owned_blocks(len(blocks), me, workers) if comm.is_worker else range(0)
    start, end = _span(blocks, mine)
    # the rows (positions among the K, ascending id) of each worker's clients, in its order
    rows_of = [np.array([position[int(c)] for c in np.asarray(a).tolist()], dtype=np.int64)
               for a in assignment]

    # 1. transpose: to every other worker, my clients' slices of its span, one after
    #    another (each sent from where it is); the slices of my own span stay in place
    local = [v.detach().reshape(-1).float().cpu().numpy() for v in vectors]
    parts = [[] for _ in range(comm.size)]
    for w in range(workers):
        if comm.is_worker and w != me:
            s, e = _span(blocks, owned_blocks(len(blocks), w, workers))
            parts[_rank_of(w, comm)] = [v[s:e] for v in local]
    others = k - len(rows_of[me]) if comm.is_worker else 0
    received = comm.alltoallv(parts, out=space.array("received", others * (end - start)))
    # what worker w sent me: its clients' slices of my span, [its clients, end - start]
    sent = [received[_rank_of(w, comm)].reshape(len(rows_of[w]), end - start)
            if w != me and len(rows_of[w]) else None for w in range(workers)]
    # one float64 buffer, reused for every block: each block of the K vectors is converted
    # where it is used (Gram, then weighted sum), with no allocation per block
    rows_k = k + (extra is not None)   # the blocks' rows: the K vectors, then ``extra``
    reference = extra.detach().reshape(-1).float().cpu().numpy() if extra is not None else None
    pinned = device is not None and device.type == "cuda" and len(mine) > 0
    buffer = space.block(rows_k * min(block, d) if len(mine) else 0, pinned)

    def rows(b: int, honest: bool = False) -> torch.Tensor:
        """Block b (one of mine) of the K vectors: float64 [K, width], clients in
        ascending id (the cohort attack's rows in place unless ``honest``)."""
        s, e = blocks[b]
        a = buffer[:rows_k * (e - s)].view(rows_k, e - s)
        target = a.numpy()
        for w in range(workers):
            if w == me:
                for row, v in zip(rows_of[w].tolist(), local):
                    target[row] = v[s:e]
            elif sent[w] is not None:
                target[rows_of[w]] = sent[w][:, s - start:e - start]
        if reference is not None:
            target[k] = reference[s:e]
        if attack is not None and not honest:
            attack.apply(a[:k], shared)
        return a if device is None or honest else a.to(device)

    # 1b. a cohort attack: its statistics of the honest rows (partials per block, added
    #     in block order on the server), then what it sends from them, to every worker
    attack = cohort.round(order) if cohort is not None else None
    shared = None
    if attack is not None:
        partials = [attack.statistics(rows(b, honest=True)[:k]) for b in mine] \
            if attack.needs_statistics else []
        gathered = comm.gatherv(np.concatenate(partials) if partials else np.zeros(0))
        shared = np.zeros(attack.shared_size)
        if comm.is_server:
            shared = attack.solve(np.concatenate(gathered).reshape(-1, attack.statistics_size)
                                  if attack.needs_statistics else None)
        comm.bcast(shared)

    # 2. Gram partials (torch's kernel, at the run's thread count), gathered in worker
    #    order, which is block order, and added in that order
    coef = None
    if coefficients is not None:
        partials = np.zeros((len(mine), rows_k, rows_k))
        for i, b in enumerate(mine):
            a = rows(b)
            partials[i] = (a @ a.T).cpu().numpy()
        gathered = comm.gatherv(partials.reshape(-1))
        coef = np.zeros(rows_k)
        if comm.is_server:
            gram = np.zeros((rows_k, rows_k))
            for partial in np.concatenate(gathered).reshape(-1, rows_k, rows_k):
                gram += partial
            coef = np.asarray(coefficients(gram), dtype=np.float64).reshape(rows_k)
        # 3. coefficients to the workers
        comm.bcast(coef)
    def combine(a, c):   # one float64 product per block: a fixed shape
        return torch.from_numpy(c).to(a.device) @ a, None
    rule = per_block if per_block is not None else combine

    # 4. each block's weighted sum (or rule), gathered to the server: the spans in worker
    #    order are the d coordinates in order; a coordinate rule's row weights, one
    #    row of K a block, to the server too (added there in block order)
    sums = space.array("sums", end - start)
    shares = np.zeros((len(mine), k))
    for i, b in enumerate(mine):
        s, e = blocks[b]
        values, share = rule(rows(b), coef)
        sums[s - start:e - start] = values.float().cpu().numpy()
        if share is not None:
            shares[i] = share.cpu().numpy()
    # gathered straight into the result: the server's part is empty where it has no
    # blocks, and all of it where it is the only rank
    total = host_vector(d, zeros=False) if comm.is_server else None
    comm.gatherv(sums, out=total.numpy() if comm.is_server else None)
    if per_block is not None:   # a coordinate rule's weights, added in block order
        parts = comm.gatherv(shares.reshape(-1))
        if comm.is_server:
            coef = np.zeros(k)
            for share in np.concatenate(parts).reshape(-1, k):
                coef += share
            coef /= max(d, 1)
    return (total, coef[:k]) if comm.is_server else (None, None)
