"""Who the clients are: partition, public set, feature skew and a dynamic population.

`federate(config, dataset)` is the one place the federated view of a dataset is made;
the runtime calls it on rank 0 and broadcasts the result, and `fedmpi partition`
calls it to preview a setting without training. Everything is a pure function of the
config and the seed.

Clients are *identities*. A static population has identities 0..N-1. A dynamic one
(FedACG Table 3: N clients, each replaced with probability p every k rounds) adds an
identity for every replacement, so a fresh client has a new id: the client state store,
keyed by id, holds nothing for it, exactly as for a newcomer in a real deployment. Its
data is slot s of a fresh draw of the same partitioner (keyed by the stage), so a
newcomer looks like the client it replaces statistically but owns different samples;
samples may be shared between a newcomer and clients of earlier draws. The table
``population[stage, slot]`` says which identity holds slot ``slot`` during a stage.

Feature skew is a per-identity triple (noise std, brightness, saturation) applied to
that client's training batches on the device (`fedmpi.data.augment.ClientSkew`); the
test set is never skewed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data import class_counts, make_partition
from ..data.augment import ClientSkew
from ..data.partition import Partition
from ..errors import UsageError
from .rng import key_seed, numpy_rng


@dataclass
class FederatedSplit(Partition):
    """A partition over client identities (M = N for a static population): identity c owns
    ``client(c)`` = ``indices[offsets[c]:offsets[c + 1]]`` (training set ids), plus who is
    in the population when and each identity's feature skew."""

    public: np.ndarray          # int64: the server's labelled set (train or test ids), may be empty
    population: np.ndarray      # int64 [stages, N]: identity in each slot, per stage
    every: int                  # rounds per stage; 0 = static population
    identity_slot: np.ndarray   # int64 [M]: the slot an identity fills
    identity_stage: np.ndarray  # int64 [M]: the stage it joined in
    noise_std: np.ndarray       # float64 [M]
    brightness: np.ndarray      # float64 [M], factor (1 = unchanged)
    saturation: np.ndarray      # float64 [M]
    noise_blocks: int           # 0: noise on the whole image; g: client's cell of a g x g grid
    # partition.local_test: identity c's local test split, test_indices[test_offsets[c]:
    # test_offsets[c + 1]] (training set ids, taken out of its training samples); None: none
    test_offsets: np.ndarray | None = None
    test_indices: np.ndarray | None = None
    # clients.holdout: the slots never sampled for training (ascending; empty: none)
    holdout: np.ndarray | None = None

    @property
    def num_identities(self) -> int:
        return self.num_clients

    def active(self, round_: int) -> np.ndarray:
        """The N identities that make up the population in round ``round_``."""
        stage = round_ // self.every if self.every else 0
        return self.population[min(stage, len(self.population) - 1)]

    def sample(self, slots: np.ndarray, round_: int) -> np.ndarray:
        """Identities of the sampled slots, ascending (the order client-order sums use)."""
        return np.sort(self.active(round_)[slots])

    def test_client(self, c: int) -> np.ndarray:
        """Identity c's local test samples (training set ids; empty without splits)."""
        if self.test_offsets is None:
            return self.indices[:0]
        return self.test_indices[self.test_offsets[c]:self.test_offsets[c + 1]]

    @property
    def test_sizes(self) -> np.ndarray:
        if self.test_offsets is None:
            return np.zeros(self.num_clients, dtype=np.int64)
        return np.diff(self.test_offsets)

    def skew(self, c: int) -> ClientSkew | None:
        skew = ClientSkew(float(self.noise_std[c]), float(self.brightness[c]),
                          float(self.saturation[c]),
                          (self.noise_blocks, int(self.identity_slot[c])) if self.noise_blocks else None)
        return None if skew.is_identity else skew

    def class_counts(self, labels: np.ndarray, num_classes: int) -> np.ndarray:
        return class_counts(self, labels, num_classes)

    def file_datasets(self, labels: np.ndarray, num_classes: int) -> dict[str, np.ndarray]:
        """What the results file keeps under /partition (docs/results-schema.md)."""
        return {"client_offsets": self.offsets, "client_indices": self.indices,
                "client_sizes": self.sizes, "public_indices": self.public,
                "class_counts": self.class_counts(labels, num_classes),
                "population": self.population, "identity_slot": self.identity_slot,
                "identity_stage": self.identity_stage, "noise_std": self.noise_std,
                "brightness": self.brightness, "saturation": self.saturation,
                **({} if self.test_offsets is None else
                   {"local_test_offsets": self.test_offsets,
                    "local_test_indices": self.test_indices,
                    "local_test_sizes": self.test_sizes}),
                **({} if self.holdout is None else {"holdout_slots": self.holdout})}

    def held_out(self, identities: np.ndarray) -> np.ndarray:
        """Whether each identity fills a held-out slot (bool)."""
        if self.holdout is None:
            return np.zeros(len(identities), dtype=bool)
        return np.isin(self.identity_slot[identities], self.holdout)


def federate(config, dataset) -> FederatedSplit:
    """The federated split of ``dataset`` that ``config`` describes (rank 0 computes it once)."""
    labels = dataset.train_y.numpy()
    groups = dataset.groups.numpy() if getattr(dataset, "groups", None) is not None else None
    public = public_indices(config, len(labels), len(dataset.test_y))
    pool = np.arange(len(labels))
    if config.data.public_from == "train" and len(public):
        pool = np.setdiff1d(pool, public)  # the public set is nobody's training data
    held = dataset.held_out.numpy() if getattr(dataset, "held_out", None) is not None else None
    if held is not None:
        pool = pool[~held[pool]]           # a natural client's own test samples: never trained
    n, p = config.clients.num, config.partition

    def draw(seed: int) -> Partition:
        part = make_partition(p.kind, labels[pool], n, seed, **p.params,
                              **({"groups": groups[pool]} if groups is not None else {}))
        return Partition(part.offsets, pool[part.indices])

    base = draw(config.seed)
    newcomers: list[np.ndarray] = []
    population, slots, stages = _population(config, newcomers, draw)
    sizes = np.concatenate([base.sizes, [len(c) for c in newcomers]]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    indices = np.concatenate([base.indices, *newcomers]).astype(np.int64)
    noise, blocks = _noise(config, slots)
    bright, sat = _colour(config, len(slots))
    split = FederatedSplit(offsets, indices, public, population, config.clients.replace_every,
                           slots, stages, noise, bright, sat, blocks)
    if config.clients.holdout:
        from ..config.validate_personal import held_out   # deferred: config imports runtime
        split.holdout = np.sort(numpy_rng(config.seed, "holdout").choice(
            n, held_out(config), replace=False)).astype(np.int64)
    if config.partition.local_test:
        split.offsets, split.indices, split.test_offsets, split.test_indices = local_test_split(
            offsets, indices, labels, config.partition.local_test, config.seed)
    elif held is not None and p.kind == "natural":
        split.test_offsets, split.test_indices = own_test_split(offsets, indices, groups, held)
    return split


def own_test_split(offsets, indices, groups, held):
    """Each natural client's local test split from the files (LEAF's per-user split): the
    held-out samples of its group, ascending; clients are whole groups, so a client's
    group is its first sample's."""
    sizes = np.diff(offsets)
    client_of_group = np.full(int(groups.max()) + 1, -1, dtype=np.int64)
    has = sizes > 0
    client_of_group[groups[indices[offsets[:-1][has]]]] = np.flatnonzero(has)
    ids = np.flatnonzero(held)
    owner = client_of_group[groups[ids]]
    ids, owner = ids[owner >= 0], owner[owner >= 0]
    order = np.lexsort((ids, owner))
    counts = np.bincount(owner, minlength=len(sizes))
    return (np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            ids[order].astype(np.int64))


def local_test_split(offsets, indices, labels, fraction: float, seed: int):
    """Each client's samples cut into a local training and a local test part: m_c =
    round(fraction n_c) clamped to [1, n_c - 1] test samples for a client of n_c >= 2
    (none for a client of one sample, which keeps it for training), stratified by label.
    A client's samples are ordered by label, ties in a keyed random order, and its test
    samples are every (n_c / m_c)-th from a keyed random start (systematic sampling:
    each label gets its share to within one sample). Returns (train offsets, train
    indices, test offsets, test indices), each client's ids ascending."""
    sizes = np.diff(offsets)
    clients = len(sizes)
    owner = np.repeat(np.arange(clients), sizes)
    rng = numpy_rng(seed, "local-test")
    ties, start = rng.random(len(indices)), rng.random(clients)
    order = np.lexsort((ties, labels[indices], owner))          # client, label, random
    tests = np.where(sizes >= 2, np.clip(np.rint(fraction * sizes), 1, sizes - 1), 0)
    tests = tests.astype(np.int64)
    who = np.repeat(np.arange(clients), tests)
    k = np.arange(int(tests.sum())) - np.repeat(np.cumsum(tests) - tests, tests)
    step = sizes[who] / tests[who]
    at = np.minimum(np.floor((k + start[who]) * step).astype(np.int64), sizes[who] - 1)
    chosen = np.zeros(len(indices), dtype=bool)
    chosen[offsets[who] + at] = True
    ordered = indices[order]
    parts = []
    for mask, counts in ((~chosen, sizes - tests), (chosen, tests)):
        ids, whose = ordered[mask], owner[mask]
        ids = ids[np.lexsort((ids, whose))]                      # ascending within a client
        parts += [np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), ids.astype(np.int64)]
    return tuple(parts)


def public_indices(config, num_train: int, num_test: int) -> np.ndarray:
    """FNR-FL's server-side labelled set: random training samples, or the first test ones."""
    size, source = config.data.public_size, config.data.public_from
    available = num_train if source == "train" else num_test
    if size >= available:
        raise UsageError(f"config field data.public_size: {size} must be below the "
                         f"{available} {source} samples")
    if source == "test":
        return np.arange(size, dtype=np.int64)
    rng = numpy_rng(config.seed, "public")
    return np.sort(rng.choice(available, size=size, replace=False)).astype(np.int64)


def _population(config, newcomers: list, draw):
    """Stage 0 is identities 0..N-1; each later stage replaces each slot with probability
    p by the same slot of a fresh partition draw. Appends the newcomers' data to
    ``newcomers`` and returns (population [stages, N], identity_slot, identity_stage)."""
    n, every, prob = config.clients.num, config.clients.replace_every, config.clients.replace_prob
    stages = -(-config.rounds // every) if every else 1
    table = np.empty((stages, n), dtype=np.int64)
    table[0] = np.arange(n)
    slots, joined = list(range(n)), [0] * n
    for k in range(1, stages):
        table[k] = table[k - 1]
        replaced = np.flatnonzero(numpy_rng(config.seed, "replace", k).random(n) < prob)
        if not len(replaced):
            continue
        fresh = draw(key_seed(config.seed, "population", k))
        for s in replaced.tolist():
            table[k, s] = n + len(newcomers)
            newcomers.append(fresh.client(s))
            slots.append(s)
            joined.append(k)
    return table, np.asarray(slots, dtype=np.int64), np.asarray(joined, dtype=np.int64)


def _noise(config, slots: np.ndarray) -> tuple[np.ndarray, int]:
    """Per-identity noise std and the block grid (NIID-Bench's two noise settings).

    level: the client in slot i of N gets std noise * i / (N - 1) over the whole image
    (FNR-FL's sigma_i; slot 0 is clean). space: every client gets std noise, but only
    inside its own cell of a g x g grid over the image, g = ceil(sqrt(N)).
    """
    p, n = config.partition, config.clients.num
    if p.noise_mode == "space":
        return np.full(len(slots), p.noise), int(np.ceil(np.sqrt(n)))
    return p.noise * slots / max(n - 1, 1), 0


def _colour(config, identities: int) -> tuple[np.ndarray, np.ndarray]:
    """Brightness and saturation factors ~ U(1 - b, 1 + b), one pair per identity, fixed."""
    p = config.partition
    u = numpy_rng(config.seed, "colour").random((identities, 2)) * 2 - 1
    return 1 + p.brightness * u[:, 0], 1 + p.saturation * u[:, 1]
