"""A million-client population: per-round cost follows the participants, not the
population. SCAFFOLD (a control variate of d values per client, kept by the client state
store, spilled to disk past system.state_memory_mb) on synthetic 8x8 images, the 2NN,
1,000 clients a round of populations 10^4, 10^5 and 10^6 (two samples a client, B = 2),
each as one `fedmpi` run under mpirun with its own processes, so that each rank's peak
resident memory (ru_maxrss) is that run's alone.

    python benchmarks/million.py                         # 3 ranks, 20 rounds, 10^4..10^6
    python benchmarks/million.py --ranks 1 --clients 1000000 --rounds 5

Prints one row per population: set-up seconds (from the start of the process to round
1), the median seconds a round over rounds 2..R (the first round pays for first touches),
and the peak memory of rank 0 and of the largest worker
(MB). Timings want an idle machine; memory does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

START = time.perf_counter()


def config(clients: int, per_round: int, rounds: int, output: str, state_dir: str) -> dict:
    return {"seed": 0, "rounds": rounds, "output": output,
            "data": {"dataset": "synthetic", "num_train": 2 * clients, "num_test": 2000,
                     "size": 8},
            "partition": {"kind": "iid"},
            "clients": {"num": clients, "per_round": per_round},
            "model": {"name": "2nn"}, "algorithm": {"name": "scaffold"},
            "train": {"batch_size": 2, "lr": 0.05},
            "eval": {"every": rounds},
            "system": {"device": "cpu", "threads": 1, "state_memory_mb": 256,
                       "state_dir": state_dir, "checkpoint_every": 0}}


def worker(args) -> None:
    """One population, on every rank of this mpirun."""
    from fedmpi import config as cfg
    from fedmpi.comm import make_comm
    from fedmpi.results import open_run
    from fedmpi.runtime import run_experiment

    comm = make_comm()
    folder = args.folder
    values = config(args.worker, args.per_round, args.rounds, os.path.join(folder, "run.h5"),
                    os.path.join(folder, "state"))
    run_experiment(cfg.from_dict(values), comm, quiet=True)
    peaks = comm.gather_obj(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, count=False)
    if comm.is_server:
        with open_run(values["output"]) as run:
            wall = run.rounds()["time_wall"]
        # rounds 1..R are rows 1..R (row 0: the initial model's evaluation)
        setup = time.perf_counter() - START - float(wall[1:].sum())
        print(json.dumps({"clients": args.worker, "ranks": comm.size, "setup_s": round(setup, 2),
                          "round_s": round(float(sorted(wall[2:])[len(wall[2:]) // 2]), 3),
                          "rank0_mb": round(peaks[0]), "worker_mb": round(max(peaks[1:] or peaks))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print("| clients | ranks | set-up (s) | s a round | rank 0 peak (MB) | largest worker peak (MB) |")
    print("|---|---|---|---|---|---|")
    for clients in args.clients:
        folder = tempfile.mkdtemp(prefix="fedmpi-million-")
        command = [sys.executable, __file__, "--worker", str(clients), "--folder", folder,
                   "--per-round", str(args.per_round), "--rounds", str(args.rounds)]
        if args.ranks > 1:
            mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
            command = [mpirun, "-n", str(args.ranks), "--oversubscribe", "--bind-to", "none"] + command
        try:
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        except subprocess.CalledProcessError as exc:
            sys.exit(f"population {clients}: exit {exc.returncode}\n{exc.stderr[-2000:]}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        row = json.loads(out.strip().splitlines()[-1])
        print(f"| {row['clients']:,} | {row['ranks']} | {row['setup_s']} | {row['round_s']} | "
              f"{row['rank0_mb']:,} | {row['worker_mb']:,} |", flush=True)


if __name__ == "__main__":
    main()
