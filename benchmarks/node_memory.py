"""Memory of an MPI run per node: is the training set held once per node?

Every rank of a run used to load the dataset and hold it (``build_world``); now the
node's lowest rank loads it into an MPI shared-memory window and the node's other ranks
map the same pages (``MPIComm.node_shared``). A shared page counts towards each
process's PSS (proportional set size) divided by the number of processes that map it,
so the sum of the ranks' PSS is the memory the run really holds on the node.

The workload: Fashion-MNIST (55 MB of uint8 images and int64 labels), 20 clients with 4
per round, the small two-conv CNN, 3 rounds, under ``mpirun -n 3`` and
``mpirun -n 5 --oversubscribe``. A sampler thread polls /proc/<pid>/smaps_rollup of the
rank processes (the ``fedmpi`` processes below mpirun) every 50 ms; it reports each
rank's peak PSS and the peak of their sum. ``idle`` is the same number of ranks that
only import fedmpi, torch and mpi4py: the per-process overhead no layout of the data
can save.

Target: with sharing, the total grows per added rank by no more than an idle rank's PSS
plus the training's own working memory (a rank's model, batches, activations), i.e. not
by another copy of the dataset; with ``FEDMPI_NODE_SHARED=0`` (every rank loads its
own copy, the old behaviour) it grows by about the dataset's size more.

    python benchmarks/node_memory.py              # shared (default) at 3 and 5 ranks
    python benchmarks/node_memory.py --compare    # ... and FEDMPI_NODE_SHARED=0 beside it
    python benchmarks/node_memory.py --ranks 3 9 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedmpi.config import to_toml

WORKLOAD = {
    "name": "node_memory", "seed": 0, "rounds": 3,
    "data": {"dataset": "fashion_mnist"},
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "clients": {"num": 20, "per_round": 4},
    "model": {"name": "cnn", "hidden": 64, "channels": [8, 16]},
    "algorithm": {"name": "fedavg"},
    "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.05},
    "eval": {"every": 1000},   # only the last round
    "system": {"threads": 1},
}

IDLE = ("import time, torch, fedmpi.runtime.experiment; from mpi4py import MPI; "
        "MPI.COMM_WORLD.Barrier(); time.sleep(2); MPI.COMM_WORLD.Barrier()")

MB = 1024 * 1024


def pss(pid: int) -> int | None:
    """Bytes of ``pid``'s proportional set size, None once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def rank_processes(root: int, marker: str) -> list[int]:
    """Descendants of ``root`` running Python with ``marker`` in their command line: the
    ranks (the launcher's own daemons are not Python)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode(errors="replace")).name.startswith("python") \
                    and any(marker.encode() in arg for arg in argv):
                found.append(child)   # not its children: a rank's short-lived fork (git)
            else:
                stack.append(child)
    return sorted(found)


class Sampler(threading.Thread):
    """Every ``interval`` s: the PSS of each rank process under ``root``; keeps each one's
    peak and the peak of their sum."""

    def __init__(self, root: int, marker: str, interval: float = 0.05):
        super().__init__(daemon=True)
        self.root, self.marker, self.interval = root, marker, interval
        self.peaks: dict[int, int] = {}
        self.peak_total = 0
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            total = 0
            for pid in rank_processes(self.root, self.marker):
                value = pss(pid)
                if value is not None:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), value)
                    total += value
            self.peak_total = max(self.peak_total, total)
            self.done.wait(self.interval)


def measure(ranks: int, args: list[str], env: dict, marker: str) -> tuple[list[int], int, float]:
    """(per-rank peak PSS in rank-pid order, peak of the total, seconds) of one launch."""
    mpirun = str(Path(sys.executable).parent / "mpirun")
    cmd = [mpirun, "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + args
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))
    sampler = Sampler(proc.pid, marker)
    sampler.start()
    out, err = proc.communicate()
    sampler.done.set()
    sampler.join()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} -> {proc.returncode}\n{out}\n{err}")
    return [sampler.peaks[pid] for pid in sorted(sampler.peaks)], sampler.peak_total, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--rounds", type=int, default=WORKLOAD["rounds"])
    ap.add_argument("--compare", action="store_true",
                    help="also run with FEDMPI_NODE_SHARED=0 (every rank loads its own copy)")
    a = ap.parse_args()
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

    from fedmpi.data import load_dataset
    data = load_dataset("fashion_mnist")
    size = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y,
                                                        data.test_x, data.test_y))
    print(f"dataset fashion_mnist: {size / MB:.1f} MB; PSS sampled every 50 ms, MB")
    del data

    modes = [("shared", {})] + ([("per-rank", {"FEDMPI_NODE_SHARED": "0"})] if a.compare else [])
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "node_memory.toml"
        config.write_text(to_toml(dict(WORKLOAD, rounds=a.rounds)))
        rows = []
        for n in a.ranks:
            peaks, total, seconds = measure(n, [sys.executable, "-c", IDLE], {}, "fedmpi.runtime")
            rows.append(("idle", n, peaks, total, seconds))
            for mode, env in modes:
                out = Path(tmp) / f"{mode}-{n}.h5"
                args = [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)]
                peaks, total, seconds = measure(n, args, env, "fedmpi")
                rows.append((mode, n, peaks, total, seconds))
    print(f"{'mode':<9} {'ranks':>5} {'total':>8} {'per added rank':>15}  {'s':>5}  per-rank peaks")
    first: dict[str, tuple[int, int]] = {}
    for mode, n, peaks, total, seconds in rows:
        n0, t0 = first.setdefault(mode, (n, total))
        growth = f"{(total - t0) / (n - n0) / MB:15.1f}" if n != n0 else f"{'':>15}"
        print(f"{mode:<9} {n:>5} {total / MB:8.1f} {growth}  {seconds:5.1f}  "
              + " ".join(f"{p / MB:.0f}" for p in peaks))


if __name__ == "__main__":
    main()
