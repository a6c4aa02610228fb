"""The seed papers' orderings at their horizons, on Fashion-MNIST: run the sweeps, print the tables.

Each paper is a sweep file in benchmarks/reproductions/ (its methods and baselines x three
seeds, the paper's heterogeneity and sampling, the local optimizer of its code); every cell
is a real `fedmpi sweep --run-cell`, so an interrupted batch resumes where it stopped and
the cells can go to a SLURM array instead (`fedmpi sweep FILE --count`). The table is
`fedmpi report` over the files: mean +- std over seeds of the final accuracy, its EMA(0.9)
(as FedACG reports), and the rounds the EMA curve takes to reach each target; then the
raw accuracy's mean over the last 40% of the rounds and the final model's norm.

    python benchmarks/reproductions.py run fedacg                  # 72 cells, 500 rounds
    python benchmarks/reproductions.py run fedacg --only feddc,fedlc --jobs 2 --threads 1
    python benchmarks/reproductions.py run fedmrur --rounds 150 --seeds 0
    python benchmarks/reproductions.py table fedacg fedmrur fedmim fnrfl

Results go to runs/reproductions-R<rounds>/<paper>/ (one directory per horizon, so a
shorter pilot never mixes with the full runs). docs/reproductions.md holds the tables
measured so far and what was checked where an ordering did not appear.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedmpi import sweep

HERE = Path(__file__).resolve().parent / "reproductions"
PAPERS = sorted(p.stem for p in HERE.glob("*.toml"))
TARGETS = ("0.80", "0.85")


def fedmpi(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedmpi", *args]


def outdir(rounds: int) -> str:
    return f"runs/reproductions-R{rounds}"


def run(paper: str, rounds: int, seeds: list[int] | None, ranks: int, threads: int,
        only: list[str] | None = None, jobs: int = 1) -> None:
    """Every cell of the sweep (or those of ``seeds`` and the algorithms ``only``), ``jobs``
    at a time; a cell whose run completed before is skipped by its own resume."""
    path = HERE / f"{paper}.toml"
    overrides = ["--set", f"rounds={rounds}", "--set", f"system.threads={threads}",
                 "--outdir", outdir(rounds)]
    cells = sweep.load(path, outdir=outdir(rounds), overrides=[f"rounds={rounds}"]).cells
    commands = []
    for cell in cells:
        values = dict(cell.values)
        if seeds is not None and values["seed"] not in seeds:
            continue
        algorithm = values.get("algorithm", {}).get("name") if isinstance(values.get("algorithm"), dict) \
            else values.get("algorithm.name")
        if only is not None and algorithm not in only:
            continue
        cmd = fedmpi("sweep", str(path), "--run-cell", str(cell.index), "-q", *overrides)
        if ranks > 1:
            cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", str(ranks),
                   "--oversubscribe", *cmd]
        commands.append((f"{paper} cell {cell.index}: {cell.name}", cmd))
    with ThreadPoolExecutor(max(jobs, 1)) as pool:
        for done in pool.map(_run_one, commands):
            print(done, flush=True)


def _run_one(item) -> str:
    label, cmd = item
    subprocess.run(cmd, check=True)
    return f"done {label}"


def table(paper: str, rounds: int) -> None:
    """Two tables: the EMA(0.9) as FedACG reports it, and the raw accuracy's mean over
    the last 40% of the rounds beside the final model's norm (an EMA lags a slow start
    for dozens of evaluations; a decay that acts harder shows as a smaller model)."""
    files = Path(outdir(rounds)) / paper
    print(f"\n### {paper}, {rounds} rounds ({files})\n", flush=True)
    targets = [a for t in TARGETS for a in ("--target", t)]
    subprocess.run(fedmpi("report", str(files), "--smooth", "0.9", *targets,
                          "--columns", "final,rounds,traffic,time", "--format", "markdown"),
                   check=True)
    window = f"{int(0.6 * rounds)}:{rounds}"
    subprocess.run(fedmpi("report", str(files), "--window", window, "--columns", "window,final,norm",
                          "--format", "markdown"), check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("run", "table"))
    ap.add_argument("papers", nargs="+", choices=PAPERS)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--seeds", type=int, nargs="*", default=None, help="only these seeds")
    ap.add_argument("--ranks", type=int, default=1, help="run each cell under mpirun -n RANKS")
    ap.add_argument("--threads", type=int, default=0, help="system.threads of every cell")
    ap.add_argument("--only", help="only the cells of these algorithm names, comma-separated")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once")
    args = ap.parse_args()
    for paper in args.papers:
        if args.action == "run":
            only = args.only.split(",") if args.only else None
            run(paper, args.rounds, args.seeds, args.ranks, args.threads, only, args.jobs)
        else:
            table(paper, args.rounds)


if __name__ == "__main__":
    main()
