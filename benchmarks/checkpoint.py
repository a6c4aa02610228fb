"""Cost of a checkpoint (written, synced to the disk, checksummed; and read back with its
check), and that the results file does not grow with their number.

A ResNet-18-sized server state (x and one momentum: 2 x 11.2M float32) plus the client
state of SCAFFOLD-like clients (one d-vector each), written N times into one file the
way the runtime does (fedmpi.results.checkpoint.write between closes of the file):

    python benchmarks/checkpoint.py                 # d = 11.2M, 10 clients, 6 checkpoints
    python benchmarks/checkpoint.py --params 1000000 --clients 100
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import h5py
import numpy as np

from fedmpi.results import checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=11_200_000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--count", type=int, default=6)
    args = parser.parse_args()
    d = args.params
    x = np.random.default_rng(0).random(d, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.h5")
        with h5py.File(path, "w") as f:
            f.create_group("rounds")
        state_mb = (2 + args.clients) * d * 4 / 1e6
        print(f"checkpoint = server 2 x {d} + {args.clients} clients x {d} float32 = {state_mb:.0f} MB")
        print(f"{'#':>3}  {'seconds':>8}  {'MB/s':>7}  {'file MB':>8}")
        for k in range(1, args.count + 1):
            start = time.perf_counter()
            with h5py.File(path, "r+") as f:
                checkpoint.write(f, k, {"x": x, "m": x}, ((c, {"c": x}) for c in range(args.clients)),
                                 {"c": d}, num_clients=args.clients)
            seconds = time.perf_counter() - start
            print(f"{k:>3}  {seconds:>8.2f}  {state_mb / seconds:>7.0f}  {os.path.getsize(path) / 1e6:>8.0f}")
        start = time.perf_counter()
        with h5py.File(path, "r") as f:   # what a resume reads: the slot, checked (CRC-32)
            checkpoint.read(f)
        print(f"read and check the current slot: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
