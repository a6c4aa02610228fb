"""Per-client evaluation's cost against a training round of the same clients.

W2 (Fashion-MNIST, 1,000 clients, Dirichlet(0.3), B = 10, E = 1, FedAvg, the 2NN by
default) with ``partition.local_test = 0.2`` and every client in every round
(``clients.per_round = 1000``), so one round trains exactly the clients an evaluation
scores; client groups on ("auto"), as a cross-device run has them. Three runs of
``--rounds`` rounds, one after another in this process, each round evaluated:

- ``global``: the global test set only (``eval.clients = "none"``);
- ``clients``: and every client on its local test split (``eval.clients = "all"``);
- ``finetune``: and each client again after fine-tuning one epoch
  (``eval.client_finetune_epochs = 1``), one client after another;
- ``ft_groups``: the same fine-tuning in client groups of ``--finetune-group``
  (``eval.client_finetune_group``).

Prints the median seconds of a round's training (``time_compute``) and of its evaluation
(``time_eval``) per run, and what scoring (and fine-tuning) every client adds to the
evaluation, as a multiple of the training round.

    python benchmarks/client_eval.py
    python benchmarks/client_eval.py --model cnn --rounds 3

What was measured, on which machine: docs/performance.md ("Per-client evaluation").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

RUNS = {"global": {"clients": "none"}, "clients": {"clients": "all"},
        "finetune": {"clients": "all", "client_finetune_epochs": 1},
        "ft_groups": {"clients": "all", "client_finetune_epochs": 1}}


def workload(model: str, rounds: int, evaluation: dict) -> dict:
    return {"name": "w2-clients", "seed": 0, "rounds": rounds,
            "data": {"dataset": "fashion_mnist"},
            "partition": {"kind": "dirichlet", "alpha": 0.3, "local_test": 0.2},
            "clients": {"num": 1000, "per_round": 1000}, "model": {"name": model},
            "algorithm": {"name": "fedavg"},
            "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.05, "grad_clip": 0.0},
            "eval": {"every": 1, "at_start": False, **evaluation},
            "system": {"client_group": "auto"}}


def medians(values: dict, out: Path) -> tuple[float, float]:
    run_experiment(cfgmod.from_dict({**values, "output": str(out)}), LocalComm(), quiet=True)
    with RunFile(out) as run:
        rounds = run.rounds()
    return float(np.median(rounds["time_compute"])), float(np.median(rounds["time_eval"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="2nn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--finetune-group", type=int, default=100)
    args = parser.parse_args()
    RUNS["ft_groups"]["client_finetune_group"] = args.finetune_group
    print(f"W2 with local test splits (0.2): Fashion-MNIST, 1000 clients Dir(0.3), all 1000 "
          f"a round, B = 10, E = 1, {args.model}, client groups auto; medians over "
          f"{args.rounds} rounds")
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, evaluation in RUNS.items():
            times[name] = medians(workload(args.model, args.rounds, evaluation),
                                  Path(tmp) / f"{name}.h5")
            print(f"  {name:9s} training {times[name][0]:7.3f} s/round   evaluation "
                  f"{times[name][1]:7.3f} s", flush=True)
    train = times["global"][0]
    scoring = times["clients"][1] - times["global"][1]
    tuning = times["finetune"][1] - times["clients"][1]
    grouped = times["ft_groups"][1] - times["clients"][1]
    print(f"  scoring every client adds {scoring:.3f} s = {scoring / train:.2f}x a training "
          f"round of the same clients; fine-tuning one epoch each adds {tuning:.3f} s = "
          f"{tuning / train:.2f}x one after another, {grouped:.3f} s = {grouped / train:.2f}x "
          f"in groups of {args.finetune_group}")


if __name__ == "__main__":
    main()
