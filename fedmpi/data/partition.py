"""Split a training set over simulated clients: IID or Dirichlet label skew.

A partition is two flat int64 arrays (CSR layout: offsets + indices) so that it can be
broadcast over MPI and stored in the HDF5 file as is, for any number of clients. Every
partitioner first computes an owner per sample, vectorised, and `_from_owner` turns that
into the CSR layout; within a client, sample indices are ascending.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmpi.errors import UsageError

_PURPOSE_PARTITION = 0x9A27  # seeds the partition stream apart from other uses of `seed`


@dataclass
class Partition:
    """Client c owns training samples indices[offsets[c]:offsets[c + 1]]."""

    offsets: np.ndarray  # int64 [num_clients + 1]
    indices: np.ndarray  # int64 [sum of client sizes]

    def client(self, c: int) -> np.ndarray:
        return self.indices[self.offsets[c]:self.offsets[c + 1]]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1


def _rng(seed: int) -> np.random.Generator:
    """A private generator for (seed, partition): never the global numpy state."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UsageError(f"seed={seed!r}: must be a non-negative integer")
    return np.random.default_rng(np.random.SeedSequence([int(seed), _PURPOSE_PARTITION]))


def _check_clients(num_clients) -> None:
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise UsageError(f"clients={num_clients!r}: must be an integer >= 1")


def _from_owner(owner: np.ndarray, num_clients: int) -> Partition:
    """CSR partition from owner[i] = client of sample i (a stable sort keeps indices ascending)."""
    indices = np.argsort(owner, kind="stable").astype(np.int64)
    counts = np.bincount(owner, minlength=num_clients)
    return Partition(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), indices)


def iid(num_samples: int, num_clients: int, seed: int) -> Partition:
    """Uniformly random split into sizes that differ by at most one."""
    _check_clients(num_clients)
    owner = np.arange(num_samples, dtype=np.int64) % num_clients
    return _from_owner(_rng(seed).permutation(owner), num_clients)


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
              min_size: int = 1) -> Partition:
    """Dirichlet label skew (Hsu et al. 2019, "Measuring the effects of non-identical data
    distribution", arXiv:1909.06335; NIID-Bench's "noniid-labeldir").

    For each class k, client shares p_k ~ Dir(alpha * 1); the class's samples, shuffled,
    are cut at floor(cumsum(p_k) * n_k). Small alpha: each client sees few classes;
    large alpha: close to IID. Client sizes are not equal.

    Unlike NIID-Bench, which redraws until every client has >= 10 samples (a loop that
    can run forever), there is one draw followed by a deterministic repair: clients below
    `min_size` receive samples taken from the largest clients, water-filling down from
    the top (any remainder stays with the lowest client ids; which of a donor's samples
    move is random). If num_clients * min_size > len(labels) no repair exists and
    UsageError is raised. min_size=0 allows empty clients.
    """
    _check_clients(num_clients)
    labels = np.asarray(labels)
    _check_dirichlet(alpha, min_size)
    if num_clients * min_size > len(labels):
        raise UsageError(f"partition.min_size={min_size} x clients={num_clients} exceeds the "
                         f"{len(labels)} training samples; lower one of them")
    rng = _rng(seed)
    owner = _label_dirichlet_owner(labels, num_clients, alpha, rng)
    return _from_owner(_repair(owner, num_clients, min_size, rng), num_clients)


def _label_dirichlet_owner(labels, num_clients, alpha, rng) -> np.ndarray:
    """owner per sample from one Dir(alpha) draw per class, all classes at once.

    Sample of within-class rank r goes to the first client c with cumsum(p_k)[c] * n_k >= r + 1,
    i.e. the cut at floor(cumsum * n_k). One searchsorted over all classes (rows offset to
    be ascending) and in-place arithmetic keep 100k clients x 100 classes fast.
    """
    _, y = np.unique(labels, return_inverse=True)
    n, n_per_class = len(y), np.bincount(y)
    order = np.lexsort((rng.random(n), y))  # grouped by class, shuffled within class
    ends = rng.dirichlet(np.full(num_clients, float(alpha)), size=len(n_per_class))
    np.cumsum(ends, axis=1, out=ends)
    ends *= n_per_class[:, None]
    ends[:, -1] = n_per_class  # the float cumsum may end just below 1
    row_offset = np.arange(len(n_per_class)) * (n + 1)
    ends += row_offset[:, None]
    cell = np.searchsorted(ends.ravel(), _rank_in_group(n_per_class) + 1 + row_offset[y[order]])
    owner = np.empty(n, dtype=np.int64)
    owner[order] = cell % num_clients
    return owner


def _repair(owner, num_clients, min_size, rng) -> np.ndarray:
    """Move samples from the largest clients to those below min_size (see `dirichlet`)."""
    sizes = np.bincount(owner, minlength=num_clients)
    need = np.maximum(min_size - sizes, 0)
    if need.sum() == 0:
        return owner
    give = _water_fill(sizes, int(need.sum()))
    by_client = np.lexsort((rng.random(len(owner)), owner))  # random order within each client
    moved = by_client[_rank_in_group(sizes) >= np.repeat(sizes - give, sizes)]
    owner = owner.copy()
    owner[moved] = np.repeat(np.arange(num_clients), need)
    return owner


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


def class_counts(partition: Partition, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [num_clients, num_classes]: how many samples of each class every client owns."""
    owner = np.repeat(np.arange(partition.num_clients), partition.sizes)
    flat = owner * num_classes + np.asarray(labels)[partition.indices]
    counts = np.bincount(flat, minlength=partition.num_clients * num_classes)
    return counts.reshape(partition.num_clients, num_classes).astype(np.int64)


def _check_dirichlet(alpha, min_size) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating)) \
            or not 0 < alpha < np.inf:
        raise UsageError(f"partition.alpha={alpha!r}: must be a number > 0")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise UsageError(f"partition.min_size={min_size!r}: must be an integer >= 0")


_REQUIRED = object()
# kind -> (parameters with defaults, value check); the config's [partition] section is
# `kind` plus these parameters, so a new kind is one entry here and one function.
_KINDS = {
    "iid": ({}, lambda: None),
    "dirichlet": ({"alpha": _REQUIRED, "min_size": 1}, _check_dirichlet),
}


def partition_params(kind: str, params: dict) -> dict:
    """Config-time check of partition.kind and its parameters; returns them with defaults."""
    if kind not in _KINDS:
        raise UsageError(f"partition.kind={kind!r} is unknown; allowed: {', '.join(_KINDS)}")
    defaults, check = _KINDS[kind]
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise UsageError(f"partition.{unknown[0]} is not used by partition.kind={kind!r}; "
                         f"allowed: {', '.join(defaults) or 'none'}")
    missing = [k for k, v in defaults.items() if v is _REQUIRED and k not in params]
    if missing:
        raise UsageError(f"partition.{missing[0]} is required for partition.kind={kind!r} (e.g. 0.3)")
    resolved = {**{k: v for k, v in defaults.items() if v is not _REQUIRED}, **params}
    check(**resolved)
    return resolved


def make_partition(kind: str, labels, num_clients, seed, **params) -> Partition:
    """Partition by name with its parameters, as named in the config (partition.<param>)."""
    params = partition_params(kind, params)
    if kind == "iid":
        return iid(len(labels), num_clients, seed)
    return dirichlet(labels, num_clients, seed=seed, **params)
