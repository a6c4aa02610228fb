"""Who takes part in a round, and which worker trains whom."""

from __future__ import annotations

import heapq

import numpy as np

from ..errors import UsageError
from .rng import numpy_rng

# clients.sampling: how S_t is drawn; clients.empty_rounds: what an empty draw means
SAMPLING = ("uniform", "bernoulli", "size")
EMPTY_ROUNDS = ("redraw", "skip")


def sample_clients(seed: int, round_: int, num_clients: int, per_round: int,
                   sampling: str = "uniform", sizes: np.ndarray | None = None,
                   empty: str = "redraw") -> np.ndarray:
    """S_t, ascending client (slot) ids; a pure function of (seed, t) and the arguments,
    never of the number of ranks. ``sampling`` (``clients.sampling``):

    - ``uniform``: ``per_round`` distinct clients, every subset equally likely;
    - ``bernoulli``: each client independently with probability q = per_round /
      num_clients, so |S_t| ~ Binomial(num_clients, q) with mean per_round (FL-Simulator's
      sampling, the code of FedMIM and FedMRUR). An empty draw is drawn again from the
      same stream until non-empty (``empty = "redraw"``, deterministic) or returned as is
      (``"skip"``: the round trains nobody);
    - ``size``: ``per_round`` distinct clients drawn one after another, each with
      probability proportional to its sample count ``sizes[i]`` among those not yet
      drawn (successive sampling; numpy's weighted choice without replacement). The
      first draw is exactly proportional to n_i; the inclusion probabilities are not
      (big clients are taken less often than per_round n_i / sum n, small ones more).
    """
    if sampling not in SAMPLING or empty not in EMPTY_ROUNDS:
        raise ValueError(f"sampling {sampling!r} / empty rounds {empty!r}: choose from "
                         f"{SAMPLING} / {EMPTY_ROUNDS}")
    rng = numpy_rng(seed, "sample", round_)
    if sampling == "bernoulli":
        q = per_round / num_clients
        chosen = np.flatnonzero(rng.random(num_clients) < q)
        while not len(chosen) and empty == "redraw":
            chosen = np.flatnonzero(rng.random(num_clients) < q)
        return chosen.astype(np.int64)
    if sampling == "size":
        weights = np.asarray(sizes, dtype=np.float64)
        if np.count_nonzero(weights) < per_round:
            raise UsageError(f"config field clients.sampling: \"size\" draws clients.per_round = "
                             f"{per_round} clients with data, but only {np.count_nonzero(weights)} "
                             f"of {num_clients} have any samples")
    if per_round == num_clients:
        return np.arange(num_clients, dtype=np.int64)
    if sampling == "size":
        return np.sort(rng.choice(num_clients, size=per_round, replace=False,
                                  p=weights / weights.sum())).astype(np.int64)
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
