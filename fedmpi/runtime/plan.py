"""Who takes part in a round, and which worker trains whom."""

from __future__ import annotations

import heapq

import numpy as np

from ..errors import UsageError
from .rng import numpy_rng

# clients.sampling: how S_t is drawn; clients.empty_rounds: what an empty draw means
from ..config.vocab import EMPTY_ROUNDS, SAMPLING


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


# What "auto" gives a client group on a CPU: rows, gradients and autograd's copies of a
# G-client group stay within this many bytes (on a GPU: a quarter of its free memory).
GROUP_MEMORY_CPU = 1 << 30
GROUP_VECTORS = 6   # d-sized float32 vectors one client of a group holds at once, about


def group_size(setting, d: int, per_round: int, num_workers: int, free_bytes: int,
               sequential_faster: bool = False) -> int:
    """``system.client_group`` resolved: the given G, or for "auto" the largest group that
    fits ``free_bytes`` (GROUP_VECTORS d floats a client) and leaves every worker a
    group of its own (ceil(per_round / workers): groups are placed whole); 1 where
    ``sequential_faster`` (benchmarks/cross_device.py, on a CPU): convolutions that
    ``torch.func.vmap`` differentiates (a model that is no chain of plain layers, or a
    bf16 step), whose views and copies over the rows lose to one client's NHWC kernels on
    cache-resident flat buffers (the McMahan CNN's hand-written gradient wins: 1.13x with
    two threads); and one-thread workers, where a group's larger kernels have no second
    thread to use and one client's small ones are as fast or faster."""
    if setting != "auto":
        return int(setting)
    if sequential_faster:
        return 1
    by_memory = free_bytes // (GROUP_VECTORS * 4 * max(d, 1))
    return int(max(1, min(by_memory, -(-per_round // max(num_workers, 1)))))


def groups(clients, sizes: np.ndarray, group: int) -> list[np.ndarray]:
    """The client groups of a phase (``system.client_group`` = ``group``): its clients in
    decreasing ``sizes`` (local steps; ties by id), cut into runs of ``group``. A group
    trains in lock-step (fedmpi.algorithms.group_sgd), so its clients have similar step
    counts and, in this order, the ones still training are always its first ones. A pure
    function of the clients and their sizes: the same groups for any number of ranks."""
    order = sorted(np.asarray(clients).tolist(), key=lambda c: (-int(sizes[c]), c))
    return [np.array(order[i:i + group], dtype=np.int64) for i in range(0, len(order), group)]


def place(clients: np.ndarray, sizes: np.ndarray, num_workers: int,
          group: int = 1) -> list[np.ndarray]:
    """Balance clients over workers by sample count (longest first onto the least loaded).

    With ``group`` > 1 the units placed are the client groups (``groups``), each whole on
    one worker, weighed by their total size. Deterministic (ties broken by client id,
    then worker index); each worker's clients come back ascending. Placement never
    changes results, only the time a round takes.
    """
    load = [(0, w) for w in range(num_workers)]
    heapq.heapify(load)
    assigned: list[list[int]] = [[] for _ in range(num_workers)]
    for unit in groups(clients, sizes, group):
        total, w = heapq.heappop(load)
        assigned[w].extend(unit.tolist())
        heapq.heappush(load, (total + sum(int(sizes[c]) for c in unit.tolist()), w))
    return [np.array(sorted(a), dtype=np.int64) for a in assigned]
