"""fedmpi, pfl-research and Flower doing the same SGD steps, timed side by side in one run.

    bash benchmarks/peers/make_venvs.sh                    # once: pfl's and Flower's venvs
    python benchmarks/peers/compare.py w1                  # cross-silo W1
    python benchmarks/peers/compare.py w2                  # cross-device W2 (2NN)
    python benchmarks/peers/compare.py w2 --model cnn --variants bare fedmpi-groups pfl bare

One pass: the workload is written once (``export.py``: data, initial weights, sampled
clients, batch order), then each variant runs in its own process, one after another,
the bare loop first and last. Variants:

- ``bare``: the bare PyTorch loop (``run_bare.py``), the reference;
- ``fedmpi``: ``fedmpi run`` in one process, clients one after another;
- ``fedmpi-groups``: the same with ``system.client_group = 50`` (W2's whole cohort);
- ``fedmpi-n3``: ``mpirun -n 3 fedmpi run`` (server + 2 one-thread workers);
- ``pfl``: pfl-research 0.6.0 (``run_pfl.py``, its own venv);
- ``flower`` / ``flower-2``: Flower 1.42.0's Ray simulation (``run_flower.py``), one
  actor of 2 CPUs / two actors of 1 CPU.

Every variant gets 2 threads (``--threads``). A round's seconds: the median over rounds
2..R (round 1 pays each framework's warm-up: actors, allocators, torch.func). Peak memory:
the largest sum of PSS over the variant's whole process tree (its children, Ray's
daemons and actors), sampled every 0.1 s. The script fails if a variant's SGD step
count differs from the workload's, and prints each final model's largest difference to
the bare loop's and its test accuracy (equal up to floating point: the same steps in
another summation order). What was measured: docs/performance.md, "Against the peers".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VENVS = HERE / ".venvs"
VARIANTS = ("bare", "fedmpi", "fedmpi-groups", "fedmpi-n3", "pfl", "flower", "flower-2")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _tree(root: int) -> list[int]:
    """root and every process descended from it or in its session."""
    parent, session = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry)], session[int(entry)] = int(fields[1]), int(fields[3])
    tree = {root}
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree or session[p] == root} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def _pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            pass
    return total / 1024


def run_tree(cmd: list[str], env: dict | None = None) -> tuple[str, float]:
    """Run cmd in its own session; its stdout and the peak PSS (MB) of its process tree."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})), start_new_session=True)
    peak = [0.0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _pss_mb(_tree(proc.pid)))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return out, peak[0]


def fedmpi_variant(variant: str, meta: dict, tmp: Path, threads: int) -> dict:
    from fedmpi import config as cfgmod
    from fedmpi.results import RunFile

    values = json.loads(json.dumps(meta["config"]))
    values["system"]["client_group"] = meta["per_round"] if variant == "fedmpi-groups" else 1
    values["system"]["threads"] = threads
    path, out = tmp / f"{variant}.toml", tmp / f"{variant}.h5"
    path.write_text(cfgmod.to_toml(values))
    cmd = [sys.executable, "-m", "fedmpi", "run", "-q", "--force", str(path), "-o", str(out)]
    if variant == "fedmpi-n3":
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", "3", "--oversubscribe",
               "--bind-to", "none"] + cmd[:-2] + ["-o", str(out), "--set", "system.threads=1"]
    _, peak = run_tree(cmd, MPI_ENV)
    with RunFile(out) as run:
        rounds, clients = run.rounds(), run.clients()
        trained = rounds["round"] >= 1
        params = np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1)
                                 for v in run.state_dict().values()])
        result = {"rounds": rounds["time_wall"][trained].tolist(),
                  "steps": int(clients["steps"].sum()), "acc": float(rounds["test_acc"][-1])}
    np.save(tmp / f"{variant}.npy", params)
    return {**result, "params": str(tmp / f"{variant}.npy"), "peak_mb": peak}


def script_variant(variant: str, workload: Path, tmp: Path, threads: int,
                   venvs: Path = VENVS) -> dict:
    name = variant.split("-")[0]
    python = sys.executable if name == "bare" else str(venvs / name / "bin" / "python")
    cmd = [python, str(HERE / f"run_{name}.py"), str(workload), str(tmp), "--threads", str(threads)]
    if variant == "flower-2":
        cmd += ["--actors", "2"]
    out, peak = run_tree(cmd)
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "peak_mb": peak}


def summarise(results: list[tuple[str, dict]], steps: int) -> list[dict]:
    bare = [r for v, r in results if v == "bare"]
    reference = np.load(bare[0]["params"]) if bare else None
    bare_round = statistics.mean(statistics.median(r["rounds"][1:]) for r in bare) if bare else None
    rows = []
    for variant, r in results:
        if r["steps"] != steps:
            raise SystemExit(f"{variant}: {r['steps']} SGD steps, the workload has {steps}")
        median = statistics.median(r["rounds"][1:] or r["rounds"])
        params = np.load(r["params"])
        rows.append({"variant": variant, "round_s": median,
                     "ratio": median / bare_round if bare_round else None,
                     "first_round_s": r["rounds"][0], "peak_mb": r["peak_mb"], "acc": r["acc"],
                     "max_diff": float(np.abs(params - reference).max()) if reference is not None else None,
                     "steps": r["steps"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=["w1", "w2"])
    ap.add_argument("--model", choices=["2nn", "cnn"], default="2nn", help="W2's model")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS,
                    default=["bare", "fedmpi", "fedmpi-groups", "pfl", "flower", "bare"])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--venvs", type=Path, default=VENVS,
                    help="where make_venvs.sh made the peers' venvs (default %(default)s)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from export import config_values, export

    if args.rounds < 2:
        ap.error(f"--rounds must be at least 2 (round 1 is each framework's warm-up), got {args.rounds}")
    for variant in args.variants:   # before any work: a missing venv is known now
        name = variant.split("-")[0]
        if name in ("pfl", "flower") and not (args.venvs / name / "bin" / "python").exists():
            ap.error(f"variant {variant}: no {args.venvs / name}; make it with "
                     f"bash benchmarks/peers/make_venvs.sh {name}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        workload = tmp / "workload.npz"
        meta = export(config_values(args.workload, args.rounds, args.model), workload)
        results = []
        for variant in args.variants:
            if variant.startswith("fedmpi"):
                r = fedmpi_variant(variant, meta, tmp, args.threads)
            else:
                r = script_variant(variant, workload, tmp, args.threads, args.venvs)
            results.append((variant, r))
            print(f"{variant}: {statistics.median(r['rounds'][1:] or r['rounds']):.3f} s a round, "
                  f"peak {r['peak_mb']:.0f} MB, acc {r['acc']:.4f}", file=sys.stderr, flush=True)
        rows = summarise(results, meta["steps"])
    label = f"{args.workload}" + (f" {args.model}" if args.workload == "w2" else "")
    print(f"\n{label}: {meta['rounds']} rounds, {meta['steps']} SGD steps, {args.threads} threads")
    print("| variant | s a round (median, rounds 2..R) | x bare | round 1 s | peak PSS MB | "
          "test acc | max abs diff to bare |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['round_s']:.3f} | {row['ratio']:.2f} | "
              f"{row['first_round_s']:.2f} | {row['peak_mb']:.0f} | {row['acc']:.4f} | "
              f"{row['max_diff']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
