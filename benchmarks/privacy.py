"""User-level DP's cost per round: a private run against the same run without it.

Fashion-MNIST over 3,000 clients (20 samples each, Dirichlet(0.3)), 300 a round by
Bernoulli sampling (q = 0.1, so the PLD accountant), FedAvg, the McMahan CNN (or
``--model 2nn``), E = 1, B = 10, evaluation only at the end; ``off`` then ``central``
(clip 1, sigma 1), one after the other in this process. Prints the median wall seconds
per round of each (the last round, which evaluates, left out), their ratio (target:
within 3%), and the parts a private round adds on the server: the noise on the d-vector
sum and epsilon after t rounds from dp-accounting (fresh, as each round computes it).

    python benchmarks/privacy.py                   # 6 rounds, the CNN
    python benchmarks/privacy.py --rounds 10 --model 2nn

What was measured, on which machine: docs/performance.md ("Differential privacy").
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedmpi import config as cfgmod
from fedmpi import privacy
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment


def workload(rounds: int, model: str) -> dict:
    return {"name": "dp", "seed": 0, "rounds": rounds,
            "data": {"dataset": "fashion_mnist"},
            "partition": {"kind": "dirichlet", "alpha": 0.3},
            "clients": {"num": 3000, "per_round": 300, "sampling": "bernoulli"},
            "model": {"name": model}, "algorithm": {"name": "fedavg"},
            "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.05},
            "eval": {"every": rounds}}


def seconds_per_round(values: dict, out: Path) -> tuple[float, int]:
    config = cfgmod.from_dict({**values, "output": str(out)})
    run_experiment(config, LocalComm(), quiet=True)
    with RunFile(out) as run:
        rounds = run.rounds()
    wall = rounds["time_wall"][rounds["round"] > 0][:-1]
    return float(np.median(wall)), len(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default="cnn")
    args = parser.parse_args()
    base = workload(args.rounds, args.model)
    private = {**base, "privacy": {"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0}}
    with tempfile.TemporaryDirectory() as tmp:
        off, n = seconds_per_round(base, Path(tmp) / "off.h5")
        on, _ = seconds_per_round(private, Path(tmp) / "on.h5")
    config = cfgmod.from_dict(private)
    from fedmpi.models import build_model   # the model's size, for the noise's cost
    d = sum(p.numel() for p in build_model(args.model, 1, 10, 28).parameters())
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.randn(d, generator=g).mul_(1.0)
    noise = (time.perf_counter() - t0) / 5
    costs = []
    for t in (1, args.rounds, 100, 500):
        privacy._epsilon.cache_clear()
        t0 = time.perf_counter()
        privacy.epsilon(config, t)
        costs.append((t, time.perf_counter() - t0))
    print(f"DP: Fashion-MNIST, 3000 clients, 300/round (Bernoulli), {args.model} "
          f"(d = {d:,}), B=10, E=1; medians of {n} rounds")
    print(f"  off      {off:.3f} s/round")
    print(f"  central  {on:.3f} s/round   ratio {on / off:.3f}   (target <= 1.03)")
    print(f"  the noise on the sum: {noise * 1e3:.1f} ms; epsilon (PLD, grid "
          f"{privacy.PLD_GRID:g}): " + ", ".join(f"{s:.2f} s at t = {t}" for t, s in costs))


if __name__ == "__main__":
    main()
