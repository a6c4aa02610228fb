"""The one-run privacy audit against the accountant: epsilon's empirical lower bound
(``privacy.audit_canaries``, Steinke, Nasr and Jagielski 2023) next to dp-accounting's
epsilon, at several noise multipliers.

Fashion-MNIST over 1,000 clients (Dirichlet(0.3)), 100 a round by Bernoulli sampling
(q = 0.1), FedAvg with user-level central DP (clip C = 1), the 2NN, E = 1, B = 10,
lr 0.05, 50 rounds, delta = 1e-5, 5,000 canaries. One run per sigma; prints a Markdown
table: sigma, the accountant's epsilon, the audit's bound (95% confidence), its correct
guesses of all, and the final accuracy. The audit's bound must stay below epsilon; without
noise it shows how much m canaries can show at most.

    python benchmarks/privacy_audit.py                       # sigma 0, 0.5, 1, 2
    python benchmarks/privacy_audit.py --sigmas 1 --rounds 10

What was measured: docs/privacy.md ("The one-run audit").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment


def workload(rounds: int, sigma: float, canaries: int) -> dict:
    return {"name": "audit", "seed": 0, "rounds": rounds,
            "data": {"dataset": "fashion_mnist"},
            "partition": {"kind": "dirichlet", "alpha": 0.3},
            "clients": {"num": 1000, "per_round": 100, "sampling": "bernoulli"},
            "model": {"name": "2nn"}, "algorithm": {"name": "fedavg"},
            "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.05},
            "eval": {"every": rounds},
            "system": {"threads": 1},
            "privacy": {"mechanism": "central", "clip": 1.0, "noise_multiplier": sigma,
                        "delta": 1e-5, "audit_canaries": canaries}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--canaries", type=int, default=5000)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0])
    args = parser.parse_args()
    print(f"one-run audit: Fashion-MNIST, 1000 clients, q = 0.1, 2NN, {args.rounds} rounds, "
          f"C = 1, delta = 1e-5, {args.canaries} canaries\n")
    print("| sigma | accountant epsilon | audit lower bound (95%) | correct / guesses | final accuracy |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for sigma in args.sigmas:
            out = Path(tmp) / f"sigma{sigma}.h5"
            config = cfgmod.from_dict({**workload(args.rounds, sigma, args.canaries),
                                       "output": str(out)})
            run_experiment(config, LocalComm(), quiet=True)
            with RunFile(out) as run:
                last = {k: v[-1] for k, v in run.rounds().items()}
            print(f"| {sigma:g} | {last['epsilon']:.3g} | {last['audit_epsilon']:.3g} | "
                  f"{last['audit_correct']:.0f} / {last['audit_guesses']:.0f} | "
                  f"{100 * last['test_acc']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
