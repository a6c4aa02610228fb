"""Clients of given sizes filled from a label supply (the balanced Dirichlet and the
quantity-skew partitions of ``fedmpi.data.partition``): sizes by water-filling, each
client's classes drawn towards its Dirichlet prior, in passes, and systematic rounding.
Seeded only through the ``rng`` passed in, so the partition's bits are unchanged."""

from __future__ import annotations

import numpy as np


def _rank_in_group(group_sizes: np.ndarray) -> np.ndarray:
    """0, 1, .., size-1 for each group in turn: positions within consecutive groups."""
    starts = np.cumsum(group_sizes) - group_sizes
    return np.arange(int(group_sizes.sum())) - np.repeat(starts, group_sizes)


def _water_fill(sizes: np.ndarray, total: int) -> np.ndarray:
    """How many samples each client gives so that `total` come off the top.

    Clients above a level L are cut down to L, the largest L that yields >= total; the
    excess is handed back, one sample each, to the lowest-id clients that were cut.
    """
    lo, hi = 0, int(sizes.max())  # binary search for L in [lo, hi]; surplus(lo) >= total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if np.maximum(sizes - mid, 0).sum() >= total else (lo, mid - 1)
    give = np.maximum(sizes - lo, 0)
    excess = int(give.sum()) - total
    at_level = np.flatnonzero(give > 0)[:excess]
    give[at_level] -= 1
    return give


def _equal_sizes(num_samples: int, num_clients: int) -> np.ndarray:
    """N // K each, the first N % K clients one more (sums to N)."""
    sizes = np.full(num_clients, num_samples // num_clients, dtype=np.int64)
    sizes[:num_samples % num_clients] += 1
    return sizes


def _quantity_sizes(num_samples, num_clients, alpha, min_size, rng) -> np.ndarray:
    """min_size each, plus the rest R cut by q ~ Dir(alpha * 1) at floor(cumsum(q) * R).

    Each client gets floor or ceil of q_c * R beyond min_size, and the sizes sum to N
    exactly: one draw, no redraw until min >= min_size as in NIID-Bench / FNR-FL.
    """
    rest = num_samples - num_clients * min_size
    cuts = np.cumsum(rng.dirichlet(np.full(num_clients, float(alpha))))
    cuts = np.minimum(np.floor(cuts * rest), rest).astype(np.int64)  # float cumsum may overshoot
    cuts[-1] = rest  # ... or end just below 1
    return min_size + np.diff(cuts, prepend=0)


def _fixed_size_owner(labels, sizes, alpha, rng) -> np.ndarray:
    """owner per sample: client i gets sizes[i] samples, classes drawn from p_i ~ Dir(alpha)."""
    _, y = np.unique(labels, return_inverse=True)
    n_per_class = np.bincount(y)
    prior = rng.dirichlet(np.full(len(n_per_class), float(alpha)), size=len(sizes))
    counts = _fill_to_sizes(sizes, n_per_class, prior, rng)
    order = np.lexsort((rng.random(len(y)), y))  # grouped by class, shuffled within class
    owner = np.empty(len(y), dtype=np.int64)
    # Class k's shuffled samples go to clients 0, 1, .. in runs of counts[:, k].
    owner[order] = np.repeat(np.tile(np.arange(len(sizes)), len(n_per_class)), counts.T.ravel())
    return owner


def _fill_to_sizes(sizes, supply, prior, rng) -> np.ndarray:
    """counts [K, C] with row sums `sizes`, column sums `supply`, row i following prior[i].

    The reference (FedDyn / FL-Simulator) hands out one sample at a time: a random client
    with room draws a class from its prior and redraws while that class is exhausted,
    which hangs once a client's prior sits on exhausted classes. Here the same process
    runs in its fluid limit, all clients at once, in at most C passes. A pass:

    1. renormalises every client's prior over the classes that still have samples (a
       client with no prior mass left there uses the remaining class supply instead);
    2. finds the largest fraction f <= 1 of every client's remaining demand d_i that the
       expected class demands D_k = sum_i d_i q_ik fit in: f = min_k supply_k / D_k, whose
       argmin k* is the bottleneck class;
    3. allocates class k* exactly: f d_i q_ik* rounded systematically (floor or ceil for
       each client, summing to supply_k*), so k* is exhausted;
    4. allocates the rest of each client's share f d_i (1 - q_ik*), stochastically rounded,
       by one multinomial over its other classes, and trims any class that this
       over-allocated back to its supply by removing the excess at random
       (multivariate hypergeometric), which exhausts that class too.

    Every pass exhausts at least one class (step 3), and as sum(d) == sum(supply) always,
    one class left means every client's share is that class and the pass completes, so C
    passes suffice. Floating-point rounding could in principle leave a few units after
    them; an exact final fill pairs those with the open places at random.
    """
    counts = np.zeros(prior.shape, dtype=np.int64)
    demand, supply = sizes.astype(np.int64).copy(), np.asarray(supply, dtype=np.int64).copy()
    for _ in range(prior.shape[1]):
        rows, cols = np.flatnonzero(demand > 0), np.flatnonzero(supply > 0)
        if len(rows) == 0:
            break
        q = _renormalised(prior[np.ix_(rows, cols)], supply[cols])
        alloc = _fill_pass(demand[rows], supply[cols], q, rng)
        counts[np.ix_(rows, cols)] += alloc
        demand[rows] -= alloc.sum(1)
        supply[cols] -= alloc.sum(0)
    slots = np.repeat(np.arange(len(demand)), demand)
    np.add.at(counts, (slots, rng.permutation(np.repeat(np.arange(len(supply)), supply))), 1)
    return counts


def _renormalised(prior: np.ndarray, supply: np.ndarray) -> np.ndarray:
    """Rows scaled to sum 1; rows with (numerically) no mass left follow the supply."""
    mass = prior.sum(1, keepdims=True)
    empty = mass[:, 0] < np.finfo(float).tiny  # tiny alpha: Dir draws underflow to exact 0
    q = prior / np.where(empty[:, None], 1.0, mass)
    q[empty] = supply / supply.sum()
    return q


def _fill_pass(demand, supply, q, rng) -> np.ndarray:
    """One pass of `_fill_to_sizes` over the open clients and classes: allocation [rows, cols]."""
    expected = demand @ q
    with np.errstate(divide="ignore", over="ignore"):  # the inf/huge ratios never win
        ratio = np.where(expected > 0, supply / expected, np.inf)
    k = int(np.argmin(ratio))
    share = min(1.0, float(ratio[k])) * demand  # f d_i
    bottleneck = np.minimum(_systematic(share * q[:, k], int(supply[k]), rng), demand)
    alloc = _allocate_others(share, q, k, demand - bottleneck, rng)
    alloc[:, k] = bottleneck
    excess = alloc.sum(0) - supply
    for j in np.flatnonzero(excess > 0):  # at most C - 1 classes
        alloc[:, j] -= rng.multivariate_hypergeometric(alloc[:, j], int(excess[j]))
    return alloc


def _allocate_others(share, q, k, room, rng) -> np.ndarray:
    """Each client's share f d_i (1 - q_ik) of the classes other than k, capped by its room:
    stochastically rounded, then one multinomial over q_i without class k."""
    others = q.copy()
    others[:, k] = 0.0
    mass = others.sum(1)
    rest = share * mass
    rest = np.floor(rest) + (rng.random(len(rest)) < rest - np.floor(rest))
    has_mass = mass > 0  # rows without have rest == 0: any valid pvals do
    others[has_mass] /= mass[has_mass, None]
    others[~has_mass] = 1.0 / q.shape[1]
    return rng.multinomial(np.minimum(rest.astype(np.int64), room), others)


def _systematic(weights: np.ndarray, total: int, rng) -> np.ndarray:
    """Integers summing to `total`, each floor or ceil of weights * total / sum(weights).

    Systematic rounding: cuts at floor(cumsum + u) for one u ~ U[0, 1).
    """
    cum = np.cumsum(weights)
    cum *= total / cum[-1]
    np.minimum(cum, total, out=cum)
    cum[-1] = total
    return np.diff(np.floor(cum + rng.random()).astype(np.int64), prepend=0)
