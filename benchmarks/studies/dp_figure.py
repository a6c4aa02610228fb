"""Accuracy against epsilon from a finished privacy sweep (benchmarks/studies/dp_fmnist.toml):
final test accuracy, mean and std over seeds, per privacy setting, as a Markdown table and
a figure (epsilon on a log axis; the clip without noise and FedAvg without DP as lines).

    python benchmarks/studies/dp_figure.py runs/studies/dp_fmnist docs/figures/dp-fmnist.png
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np

import fedmpi.analysis as fa


def groups(runs) -> dict:
    """(label, target epsilon or inf or None) -> [(final accuracy, spent epsilon)]."""
    out = defaultdict(list)
    for run in runs:
        p = run.config.get("privacy", {})
        if p.get("mechanism", "off") == "off":
            key = ("FedAvg, no DP", None)
        elif not p.get("target_epsilon") and not p.get("noise_multiplier"):
            key = ("clip only (eps = inf)", math.inf)
        else:
            key = (f"eps = {p['target_epsilon']:g}", float(p["target_epsilon"]))
        out[key].append((fa.final_accuracy(run), fa.last_value(run, "epsilon"),
                         p.get("noise_multiplier", 0.0)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir")
    parser.add_argument("figure")
    args = parser.parse_args()
    runs = [r for r in fa.load(args.sweep_dir) if r.status == "completed"]
    table = groups(runs)
    order = sorted(table, key=lambda k: (k[1] is None, -1 if k[1] is None else k[1]))
    print("| setting | sigma | epsilon spent | seeds | final accuracy % |")
    print("|---|---|---|---|---|")
    for key in order:
        rows = np.array(table[key], dtype=float)
        acc = 100 * rows[:, 0]
        sigma = ", ".join(f"{s:.3g}" for s in sorted(set(rows[:, 2])))
        spent = "-" if key[1] is None else f"{np.max(rows[:, 1]):.3g}"
        std = f" ± {acc.std(ddof=1):.2f}" if len(acc) > 1 else ""
        print(f"| {key[0]} | {sigma} | {spent} | {len(acc)} | {acc.mean():.2f}{std} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.4))
    finite = [k for k in order if k[1] is not None and math.isfinite(k[1])]
    eps = [k[1] for k in finite]
    means = [100 * np.mean([a for a, _, _ in table[k]]) for k in finite]
    stds = [100 * np.std([a for a, _, _ in table[k]], ddof=1) if len(table[k]) > 1 else 0
            for k in finite]
    ax.errorbar(eps, means, yerr=stds, marker="o", capsize=3, label="DP-FedAvg (central)")
    for key, style in ((("clip only (eps = inf)", math.inf), "--"), (("FedAvg, no DP", None), ":")):
        if key in table:
            ax.axhline(100 * np.mean([a for a, _, _ in table[key]]), linestyle=style,
                       color="gray", label=key[0])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon after the run (delta = 1/N^1.1)")
    ax.set_ylabel("final test accuracy %")
    ax.set_title("Fashion-MNIST, 3,000 clients, q = 0.1, 100 rounds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.figure, dpi=120)
    print(f"\nfigure: {args.figure}")


if __name__ == "__main__":
    main()
