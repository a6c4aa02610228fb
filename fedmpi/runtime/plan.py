"""Who takes part in a round, and which worker trains whom."""

from __future__ import annotations

import heapq

import numpy as np

from .rng import numpy_rng


def sample_clients(seed: int, round_: int, num_clients: int, per_round: int) -> np.ndarray:
    """S_t: ``per_round`` distinct clients drawn uniformly, ascending. Keyed by (seed, t)."""
    rng = numpy_rng(seed, "sample", round_)
    if per_round == num_clients:
        return np.arange(num_clients, dtype=np.int64)
    return np.sort(rng.choice(num_clients, size=per_round, replace=False)).astype(np.int64)


def place(clients: np.ndarray, sizes: np.ndarray, num_workers: int) -> list[np.ndarray]:
    """Balance clients over workers by sample count (longest first onto the least loaded).

    Deterministic (ties broken by client id, then worker index); each worker's clients
    come back ascending. Placement never changes results, only the time a round takes.
    """
    order = sorted(clients.tolist(), key=lambda c: (-int(sizes[c]), c))
    load = [(0, w) for w in range(num_workers)]
    heapq.heapify(load)
    assigned: list[list[int]] = [[] for _ in range(num_workers)]
    for c in order:
        total, w = heapq.heappop(load)
        assigned[w].append(c)
        heapq.heappush(load, (total + int(sizes[c]), w))
    return [np.array(sorted(a), dtype=np.int64) for a in assigned]
