"""Sample-level DP-SGD's cost per local step: the same clients' local training with and
without ``privacy.mechanism = "sample"``.

Fashion-MNIST over 10 clients (IID, 6,000 samples each), all every round (cross-silo),
B = 32, E = 1, one round per run, one client after another; per model (the 2NN and the
McMahan CNN) a plain run, then a DP-SGD run (C = 1, sigma = 1), one after the other in
this process. Prints the seconds per local step of each (the round's compute time over
its steps) and their ratio. DP-SGD's batches are Poisson (expected size B), its gradient
is every sample's, clipped: the per-sample gradients are the whole difference.

    python benchmarks/privacy_sgd.py                    # both models
    python benchmarks/privacy_sgd.py --models 2nn --clients 4

What was measured, on which machine: docs/performance.md ("DP-SGD").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment


def workload(model: str, clients: int, private: bool) -> dict:
    values = {"name": "dpsgd", "seed": 0, "rounds": 1,
              "data": {"dataset": "fashion_mnist"}, "partition": {"kind": "iid"},
              "clients": {"num": clients, "per_round": clients},
              "model": {"name": model}, "algorithm": {"name": "fedavg"},
              "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
              "eval": {"every": 1, "at_start": False}, "system": {"client_group": 1}}
    if private:
        values["privacy"] = {"mechanism": "sample", "clip": 1.0, "noise_multiplier": 1.0}
    return values


def seconds_per_step(values: dict, out: Path) -> float:
    run_experiment(cfgmod.from_dict({**values, "output": str(out)}), LocalComm(), quiet=True)
    with RunFile(out) as run:
        compute = float(run.rounds()["time_compute"][-1])
        steps = int(run.clients()["steps"].sum())
    return compute / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["2nn", "cnn"])
    parser.add_argument("--clients", type=int, default=10)
    args = parser.parse_args()
    print(f"DP-SGD: Fashion-MNIST, {args.clients} clients (IID), B = 32, E = 1, one client "
          f"after another; seconds per local step")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            plain = seconds_per_step(workload(model, args.clients, False),
                                     Path(tmp) / f"{model}-plain.h5")
            dp = seconds_per_step(workload(model, args.clients, True), Path(tmp) / f"{model}-dp.h5")
            print(f"  {model:4s}  plain {1e3 * plain:7.2f} ms   DP-SGD {1e3 * dp:7.2f} ms   "
                  f"ratio {dp / plain:.2f}", flush=True)


if __name__ == "__main__":
    main()
