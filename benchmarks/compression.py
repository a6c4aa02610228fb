"""Accuracy against uploaded MB under each upload codec, on Fashion-MNIST.

100 clients with Dirichlet(0.3) label skew, 10 per round, FedAvg, the McMahan CNN, E = 1,
B = 50, lr 0.05, evaluated every 5 rounds. One run per codec, one after another:

- ``none``: float32 uploads (the reference);
- ``fp16``: the cast;
- ``qsgd8``, ``qsgd4``: QSGD with buckets of 512 and 7 or 3 level bits plus a sign bit
  (8 and 4 bits a value);
- ``topk``, ``topk_ef``: the top 1% of the update, without and with error feedback;
- ``sign_ef``: scaled sign with error feedback.

Writes the runs under ``--out`` (a finished run is kept and not run again), prints the
table of final accuracy, uploaded MB and MB a round (``fedmpi report``), and draws
accuracy against the cumulative uploaded MB (``fedmpi plot --x upload``).

    python benchmarks/compression.py                       # 100 rounds
    python benchmarks/compression.py --rounds 20 --only none topk_ef
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from fedmpi import config as cfgmod
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

CODECS = {
    "none": {},
    "fp16": {"up": "fp16"},
    "qsgd8": {"up": "qsgd", "bits": 7, "bucket": 512},
    "qsgd4": {"up": "qsgd", "bits": 3, "bucket": 512},
    "topk": {"up": "topk", "fraction": 0.01},
    "topk_ef": {"up": "topk", "fraction": 0.01, "error_feedback": True},
    "sign_ef": {"up": "sign", "error_feedback": True},
}


def workload(rounds: int, codec: str, threads: int) -> dict:
    return {"name": f"compression-{codec}", "seed": 0, "rounds": rounds,
            "data": {"dataset": "fashion_mnist"},
            "partition": {"kind": "dirichlet", "alpha": 0.3},
            "clients": {"num": 100, "per_round": 10},
            "model": {"name": "cnn"}, "algorithm": {"name": "fedavg"},
            "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.05},
            "eval": {"every": 5}, "system": {"threads": threads},
            "compression": CODECS[codec]}


def finished(path: Path) -> bool:
    if not path.exists():
        return False
    with RunFile(path) as r:
        return r.status == "completed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--only", nargs="+", choices=list(CODECS), default=list(CODECS))
    ap.add_argument("--threads", type=int, default=0, help="system.threads (0: all cores)")
    ap.add_argument("--out", type=Path, default=Path("runs/compression"))
    ap.add_argument("--figure", type=Path, default=Path("docs/figures/compression-fmnist.png"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = []
    for codec in args.only:
        path = args.out / f"{codec}-R{args.rounds}.h5"
        paths.append(str(path))
        if finished(path):
            print(f"{codec}: kept {path}", flush=True)
            continue
        values = {**workload(args.rounds, codec, args.threads), "output": str(path)}
        run_experiment(cfgmod.from_dict(values), quiet=True, force=True)
        print(f"{codec}: done", flush=True)
    fedmpi = [sys.executable, "-m", "fedmpi"]
    groups = ["-g", "compression.up", "-g", "compression.bits", "-g", "compression.error_feedback"]
    subprocess.run(fedmpi + ["report", *paths, *groups, "--columns", "final,best,upload,per_round",
                             "--format", "markdown"], check=True)
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(fedmpi + ["plot", *paths, *groups, "--x", "upload", "--log-x",
                             "-o", str(args.figure), "--title",
                             f"FedAvg, Fashion-MNIST, 100 clients Dir(0.3), {args.rounds} rounds"],
                   check=True)


if __name__ == "__main__":
    main()
