"""Split a training set over simulated clients: the heterogeneity settings of the seed papers.

Kinds (config ``[partition] kind`` + parameters, checked by `partition_params`):

- ``iid``: uniformly random, sizes differ by at most one.
- ``dirichlet``: label skew, Dir(alpha) (Hsu et al. 2019). By default per class over
  clients (unequal sizes); ``balanced = true`` gives every client the same size and
  ``quantity_alpha`` sizes from a Dirichlet (label + quantity skew), both filled from a
  client-wise Dir(alpha) label prior (FedDyn / FL-Simulator, as FedACG and FedMRUR use).
- ``pathological``: every client holds exactly ``n`` classes (McMahan et al.'s shards,
  without their unevenness).
- ``quantity``: labels IID, client sizes ~ Dir(alpha) over clients (NIID-Bench, FNR-FL).
- ``natural``: the dataset's own clients (Shakespeare's (play, role) speakers).

A partition is two flat int64 arrays (CSR layout: offsets + indices) so that it can be
broadcast over MPI and stored in the HDF5 file as is, for any number of clients. Every
partitioner first computes an owner per sample, vectorised, and `_from_owner` turns that
into the CSR layout; within a client, sample indices are ascending.

No partitioner redraws until a condition holds (the reference codes' ``while
min_size < 10`` loops can spin forever, PFLlib#130): each makes a fixed number of random
draws followed by a deterministic repair or a bounded number of vectorised passes, and an
impossible request is a one-line `UsageError` naming the config field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fedmpi.data.partition_fill import (_equal_sizes, _fixed_size_owner, _quantity_sizes,
                                        _rank_in_group, _water_fill)
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
    """CSR partition from owner[i] = client of sample i (a stable sort keeps indices ascending).

    owner[i] == num_clients marks a sample that belongs to nobody (`natural` on a subset
    of the groups); it sorts last and is cut off.
    """
    counts = np.bincount(owner, minlength=num_clients)[:num_clients]
    indices = np.argsort(owner, kind="stable")[:int(counts.sum())].astype(np.int64)
    return Partition(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), indices)


def iid(num_samples: int, num_clients: int, seed: int) -> Partition:
    """Uniformly random split into sizes that differ by at most one."""
    _check_clients(num_clients)
    owner = np.arange(num_samples, dtype=np.int64) % num_clients
    return _from_owner(_rng(seed).permutation(owner), num_clients)


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
              min_size: int = 1, balanced: bool = False,
              quantity_alpha: float | None = None) -> Partition:
    """Dirichlet label skew (Hsu et al. 2019, "Measuring the effects of non-identical data
    distribution", arXiv:1909.06335; NIID-Bench's "noniid-labeldir").

    Default (per class over clients): for each class k, client shares p_k ~ Dir(alpha * 1);
    the class's samples, shuffled, are cut at floor(cumsum(p_k) * n_k). Small alpha: each
    client sees few classes; large alpha: close to IID. Client sizes are not equal.
    Unlike NIID-Bench, which redraws until every client has >= 10 samples (a loop that
    can run forever), there is one draw followed by a deterministic repair: clients below
    `min_size` receive samples taken from the largest clients, water-filling down from
    the top (any remainder stays with the lowest client ids; which of a donor's samples
    move is random). min_size=0 allows empty clients.

    Fixed sizes (client-wise prior, FedDyn's and FL-Simulator's split used by FedACG and
    FedMRUR): client i draws class proportions p_i ~ Dir(alpha * 1) over the classes and
    fills a size fixed in advance from them -- `balanced`: N // K each, the first N % K
    clients one more; `quantity_alpha`: sizes from `quantity`'s rule (min_size each plus
    Dir(quantity_alpha) shares of the rest), i.e. label + quantity skew. See
    `_fill_to_sizes` for how the fill replaces the reference's unit-at-a-time rejection
    loop; sizes and class totals are exact.

    If num_clients * min_size > len(labels) no split exists and UsageError is raised.
    """
    _check_clients(num_clients)
    labels = np.asarray(labels)
    _check_dirichlet(alpha, min_size, balanced, quantity_alpha)
    _check_fits(len(labels), num_clients, min_size)
    rng = _rng(seed)
    if balanced or quantity_alpha is not None:
        sizes = (_equal_sizes(len(labels), num_clients) if balanced else
                 _quantity_sizes(len(labels), num_clients, quantity_alpha, min_size, rng))
        return _from_owner(_fixed_size_owner(labels, sizes, alpha, rng), num_clients)
    owner = _label_dirichlet_owner(labels, num_clients, alpha, rng)
    return _from_owner(_repair(owner, num_clients, min_size, rng), num_clients)


def _check_fits(num_samples: int, num_clients: int, min_size: int) -> None:
    if num_clients * min_size > num_samples:
        raise UsageError(f"partition.min_size={min_size} x clients={num_clients} exceeds the "
                         f"{num_samples} training samples; lower one of them")


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


def pathological(labels: np.ndarray, num_clients: int, n: int, seed: int,
                 min_size: int = 1) -> Partition:
    """Pathological-n label skew: every client holds exactly n distinct classes.

    McMahan et al. (2017) sort by label and give each client 2 random shards, so clients
    hold 1 or 2 classes and some classes more clients than others. Here the classes are
    dealt so that every class has the same number of holders up to one: clients go in
    blocks of C; block b draws its own class permutation pi_b and its r-th client holds
    pi_b[(r * n + j) mod C] for j < n (n consecutive entries of a cycle are distinct, a
    full block covers every class exactly n times, and fresh permutations make the class
    combinations random across blocks). Each class's samples, shuffled, are then split
    among its holders (in random order) into parts that differ by at most one. (With
    min_size=0 and fewer samples than holders, a holder can get none of a class.)

    Every client then gets >= ceil(min_size / n) samples of each of its classes when the
    smallest class has that many for each of its ceil(K n / C) holders; a larger K is a
    UsageError that says how many clients fit (min_size=0 lifts it). n > C, or K n < C
    (some class would have no holder and its samples no owner), is a UsageError too.
    """
    _check_clients(num_clients)
    _check_pathological(n, min_size)
    _, y = np.unique(np.asarray(labels), return_inverse=True)
    n_per_class = np.bincount(y)
    _check_pathological_fits(n_per_class, num_clients, n, min_size)
    rng = _rng(seed)
    num_classes = len(n_per_class)
    blocks = -(-num_clients // num_classes)
    perms = np.argsort(rng.random((blocks, num_classes)), axis=1)
    c = np.arange(num_clients)[:, None]
    held = perms[c // num_classes, ((c % num_classes) * n + np.arange(n)) % num_classes]
    holders = np.lexsort((rng.random(held.size), held.ravel()))  # slot ids by class, shuffled
    num_holders = np.bincount(held.ravel(), minlength=num_classes)
    first_holder = np.cumsum(num_holders) - num_holders
    order = np.lexsort((rng.random(len(y)), y))
    yo = y[order]
    rank = _rank_in_group(n_per_class)
    slot = holders[first_holder[yo] + rank * num_holders[yo] // n_per_class[yo]]
    owner = np.empty(len(y), dtype=np.int64)
    owner[order] = slot // n
    return _from_owner(owner, num_clients)


def _check_pathological_fits(n_per_class, num_clients, n, min_size) -> None:
    num_classes = len(n_per_class)
    if n > num_classes:
        raise UsageError(f"partition.n={n}: must be at most the {num_classes} classes of the "
                         f"training labels")
    if num_clients * n < num_classes:
        raise UsageError(f"partition.n={n} x clients.num={num_clients} < {num_classes} classes: "
                         f"some class would have no client; raise one of them")
    per_class = -(-min_size // n)  # what each of a client's n classes must give it
    most_holders = -(-num_clients * n // num_classes)
    if per_class and n_per_class.min() < most_holders * per_class:
        fit = n_per_class.min() // per_class * num_classes // n
        raise UsageError(f"clients.num={num_clients}: with partition.n={n} up to {most_holders} "
                         f"clients share a class and the smallest class has {n_per_class.min()} "
                         f"samples; at most {fit} clients get partition.min_size={min_size} "
                         f"(or set partition.min_size = 0)")


def quantity(labels, num_clients: int, alpha: float, seed: int, min_size: int = 10) -> Partition:
    """Quantity skew (NIID-Bench "iid-diff-quantity", FNR-FL): labels IID, sizes skewed.

    `labels` may be the label array or just the number of samples. Sizes are min_size
    each plus Dir(alpha) shares of the rest, exactly rounded (`_quantity_sizes`); the
    reference codes redraw the shares until the smallest client has >= 10 samples, which
    need not terminate. Samples are dealt uniformly at random. K * min_size > N is a
    UsageError.
    """
    _check_clients(num_clients)
    num_samples = int(labels) if isinstance(labels, (int, np.integer)) else len(labels)
    _check_quantity(alpha, min_size)
    _check_fits(num_samples, num_clients, min_size)
    rng = _rng(seed)
    sizes = _quantity_sizes(num_samples, num_clients, alpha, min_size, rng)
    owner = np.repeat(np.arange(num_clients, dtype=np.int64), sizes)
    return _from_owner(rng.permutation(owner), num_clients)


def natural(groups: np.ndarray, num_clients: int, seed: int, min_size: int = 1) -> Partition:
    """The dataset's own clients: groups[i] is the natural client of sample i (Shakespeare:
    its (play, role)), as in LEAF.

    Groups with fewer than min_size samples are never clients. With as many clients as
    the remaining groups, client c is the c-th of them in ascending group id; with fewer,
    a seeded random subset of them is taken (client c = the c-th chosen, ascending id)
    and the samples of the unchosen groups belong to nobody: the partition then covers
    only part of the training set. More clients than groups is a UsageError.
    """
    _check_clients(num_clients)
    _check_natural(min_size)
    ids, group_of, sizes = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
    eligible = np.flatnonzero(sizes >= min_size)  # positions in `ids`, ascending
    if num_clients > len(eligible):
        raise UsageError(f"clients.num={num_clients}: the dataset has {len(eligible)} natural "
                         f"clients with >= partition.min_size={min_size} samples; use at most "
                         f"{len(eligible)}")
    if num_clients < len(eligible):
        eligible = np.sort(_rng(seed).choice(eligible, size=num_clients, replace=False))
    client_of = np.full(len(ids), num_clients, dtype=np.int64)  # num_clients = nobody
    client_of[eligible] = np.arange(num_clients)
    return _from_owner(client_of[group_of.ravel()], num_clients)


def class_counts(partition: Partition, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [num_clients, num_classes]: how many samples of each class every client owns."""
    owner = np.repeat(np.arange(partition.num_clients), partition.sizes)
    flat = owner * num_classes + np.asarray(labels)[partition.indices]
    counts = np.bincount(flat, minlength=partition.num_clients * num_classes)
    return counts.reshape(partition.num_clients, num_classes).astype(np.int64)


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 < value < np.inf:
        raise UsageError(f"partition.{name}={value!r}: must be a number > 0")


def _check_count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise UsageError(f"partition.{name}={value!r}: must be an integer >= {least}")


def _check_dirichlet(alpha, min_size, balanced=False, quantity_alpha=None) -> None:
    _check_positive("alpha", alpha)
    _check_count("min_size", min_size, 0)
    if not isinstance(balanced, (bool, np.bool_)):
        raise UsageError(f"partition.balanced={balanced!r}: must be true or false")
    if quantity_alpha is not None:
        _check_positive("quantity_alpha", quantity_alpha)
        if balanced:
            raise UsageError(f"partition.quantity_alpha={quantity_alpha!r} sets unequal client "
                             f"sizes and partition.balanced = true equal ones; use one of them")


def _check_pathological(n, min_size) -> None:
    _check_count("n", n, 1)
    _check_count("min_size", min_size, 0)


def _check_quantity(alpha, min_size) -> None:
    _check_positive("alpha", alpha)
    _check_count("min_size", min_size, 0)


def _check_natural(min_size) -> None:
    _check_count("min_size", min_size, 0)


def _natural_from(labels, num_clients, seed, groups, **params) -> Partition:
    if groups is None:
        raise UsageError("partition.kind='natural' needs a dataset with natural clients "
                         "(shakespeare, or an arrays file with 'groups')")
    if len(groups) != len(labels):
        raise ValueError(f"groups has {len(groups)} entries for {len(labels)} labels")
    return natural(groups, num_clients, seed, **params)


@dataclass(frozen=True)
class _Kind:
    defaults: dict  # parameter -> default (_REQUIRED: must be given)
    check: Callable[..., None]  # config-time value check, called with every parameter
    build: Callable[..., Partition]  # (labels, num_clients, seed, groups, **params)


def _on_labels(partitioner) -> Callable[..., Partition]:
    """A `_Kind.build` for a partitioner of (labels, num_clients, ..., seed=, **params)."""
    return lambda labels, k, seed, groups, **p: partitioner(labels, k, seed=seed, **p)


_REQUIRED = object()
_EXAMPLES = {"alpha": "0.3", "n": "2"}
# kind -> _Kind; the config's [partition] section is `kind` plus these parameters, so a
# new kind is one entry here and one function.
_KINDS = {
    "iid": _Kind({}, lambda: None, lambda labels, k, seed, groups: iid(len(labels), k, seed)),
    "dirichlet": _Kind({"alpha": _REQUIRED, "min_size": 1, "balanced": False,
                        "quantity_alpha": None}, _check_dirichlet, _on_labels(dirichlet)),
    "pathological": _Kind({"n": _REQUIRED, "min_size": 1}, _check_pathological,
                          _on_labels(pathological)),
    "quantity": _Kind({"alpha": _REQUIRED, "min_size": 10}, _check_quantity, _on_labels(quantity)),
    "natural": _Kind({"min_size": 1}, _check_natural, _natural_from),
}


def partition_params(kind: str, params: dict) -> dict:
    """Config-time check of partition.kind and its parameters; returns them with defaults."""
    if kind not in _KINDS:
        raise UsageError(f"partition.kind={kind!r} is unknown; allowed: {', '.join(_KINDS)}")
    defaults, check = _KINDS[kind].defaults, _KINDS[kind].check
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise UsageError(f"partition.{unknown[0]} is not used by partition.kind={kind!r}; "
                         f"allowed: {', '.join(defaults) or 'none'}")
    missing = [k for k, v in defaults.items() if v is _REQUIRED and k not in params]
    if missing:
        raise UsageError(f"partition.{missing[0]} is required for partition.kind={kind!r} "
                         f"(e.g. {_EXAMPLES[missing[0]]})")
    resolved = {**{k: v for k, v in defaults.items() if v is not _REQUIRED}, **params}
    check(**resolved)
    return resolved


def make_partition(kind: str, labels, num_clients, seed, groups=None, **params) -> Partition:
    """Partition by name with its parameters, as named in the config (partition.<param>).

    `groups` (int per sample, or None) are the dataset's natural clients; only kind
    "natural" uses them.
    """
    params = partition_params(kind, params)
    return _KINDS[kind].build(labels, num_clients, seed, groups, **params)
