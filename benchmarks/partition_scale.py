"""Partitioning at scale: 50,000 samples into 100,000 clients.

For every partition kind, times (median of --repeats runs) computing the partition, its
client x class count matrix (what the results file stores), and sampling one round of
1,000 of the 100,000 clients with `fedmpi.runtime.plan.sample_clients`; the target is
well under 2 s for partition + sampling. 100 clients are timed too, for reference.

Labels are the first 50,000 of real Fashion-MNIST when /usr/share/datasets/fashion-mnist
exists (Debian dataset-fashion-mnist), else seeded uniform labels over 10 classes. With
100,000 clients for 50,000 samples most clients are empty, so min_size = 0 throughout.

    python benchmarks/partition_scale.py [--repeats 3] [--clients 100000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fedmpi.data import class_counts, load_dataset, make_partition  # noqa: E402
from fedmpi.runtime.plan import sample_clients  # noqa: E402

NUM_SAMPLES = 50_000
SEED = 0
KINDS = {  # row label -> (kind, params)
    "iid": ("iid", {}),
    "dirichlet alpha=0.3": ("dirichlet", {"alpha": 0.3, "min_size": 0}),
    "dirichlet alpha=0.3 balanced": ("dirichlet", {"alpha": 0.3, "min_size": 0, "balanced": True}),
    "dirichlet alpha=0.3 + quantity 0.5": ("dirichlet", {"alpha": 0.3, "min_size": 0,
                                                         "quantity_alpha": 0.5}),
    "pathological n=2": ("pathological", {"n": 2, "min_size": 0}),
    "quantity alpha=0.5": ("quantity", {"alpha": 0.5, "min_size": 0}),
}


def labels_to_partition() -> tuple[np.ndarray, str]:
    if Path("/usr/share/datasets/fashion-mnist").exists():
        labels = load_dataset("fashion_mnist").train_y.numpy()[:NUM_SAMPLES]
        return labels.astype(np.int64), "Fashion-MNIST train labels [:50000]"
    return np.random.default_rng(SEED).integers(0, 10, NUM_SAMPLES), "seeded uniform labels"


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def time_kind(labels, kind, params, num_clients, per_round, repeats) -> tuple[float, float, float]:
    """Median seconds of (partition, class_counts, sampling a round) for one kind."""
    t_part, part = median_seconds(lambda: make_partition(kind, labels, num_clients, SEED, **params),
                                  repeats)
    assert part.sizes.sum() == len(labels) and part.num_clients == num_clients
    t_counts, _ = median_seconds(lambda: class_counts(part, labels, 10), repeats)
    rounds = iter(range(10 ** 6))  # a new round each repeat: no caching can help
    t_sample, _ = median_seconds(lambda: sample_clients(SEED, next(rounds), num_clients, per_round),
                                 repeats)
    return t_part, t_counts, t_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=100_000)
    args = parser.parse_args()
    labels, source = labels_to_partition()
    print(f"{len(labels)} samples ({source}), median of {args.repeats}; times in ms")
    header = (f"{'kind':<36}{'K=100':>8}{'K=' + format(args.clients, ','):>12}{'counts':>9}"
              f"{'sample':>9}{'part+sample':>13}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for label, (kind, params) in KINDS.items():
        small, _, _ = time_kind(labels, kind, params, 100, 10, args.repeats)
        part, counts, sample = time_kind(labels, kind, params, args.clients, 1000, args.repeats)
        worst = max(worst, part + sample)
        print(f"{label:<36}{small * 1e3:>8.1f}{part * 1e3:>12.1f}{counts * 1e3:>9.1f}"
              f"{sample * 1e3:>9.1f}{(part + sample) * 1e3:>13.1f}")
    print(f"slowest partition + sampling at {args.clients:,} clients: {worst:.3f} s "
          f"(target: well under 2 s)")


if __name__ == "__main__":
    main()
