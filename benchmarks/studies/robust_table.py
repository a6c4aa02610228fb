"""The attack x defence table from finished robustness sweeps
(benchmarks/studies/robust_fmnist.toml, robust_fmnist_history.toml), as the robustness
papers print it: one row per attack, one column per defence, the final test accuracy
(mean ± std over seeds, in %) and, for the data attacks, the attack's success.

    python benchmarks/studies/robust_table.py runs/studies/robust_fmnist runs/studies/robust_fmnist_history
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

import fedmpi.analysis as fa

ATTACKS = ["none", "sign_flip", "alie", "ipm", "min_max", "label_flip", "backdoor"]
RULES = ["mean", "median", "trimmed_mean", "krum", "multikrum", "geomed", "bulyan",
         "centered_clip", "fltrust", "normbound"]


def cells(runs) -> dict:
    """(attack, rule) -> [(final accuracy, last attack success or NaN, seed)]."""
    out = defaultdict(list)
    for run in runs:
        attack = run.config.get("attack", {}).get("kind", "none")
        rule = run.config.get("robust", {}).get("aggregator", "none")
        success = fa.last_value(run, "attack_success") if attack in ("label_flip", "backdoor") \
            else float("nan")
        out[(attack, rule)].append((fa.final_accuracy(run), success, run.get("seed")))
    return out


def stat(values) -> str:
    values = [v for v in values if np.isfinite(v)]
    if not values:
        return ""
    mean = 100 * np.mean(values)
    if len(values) == 1:
        return f"{mean:.1f} (1)"
    return f"{mean:.1f} ± {100 * np.std(values, ddof=1):.1f}" + \
        ("" if len(values) == 3 else f" ({len(values)})")


def table(found: dict, column: int, attacks) -> str:
    rules = [r for r in RULES if any((a, r) in found for a in attacks)]
    lines = ["| attack | " + " | ".join(rules) + " |", "|---" * (len(rules) + 1) + "|"]
    for attack in attacks:
        row = [stat([c[column] for c in found.get((attack, r), [])]) for r in rules]
        lines.append(f"| {attack} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", nargs="+")
    args = parser.parse_args()
    runs = [r for d in args.sweep_dirs for r in fa.load(d) if r.status == "completed"]
    found = cells(runs)
    print("Final test accuracy, % (mean ± std over seeds; (n): runs where fewer than 3)\n")
    print(table(found, 0, ATTACKS))
    print("\nAttack success, % (the data attacks)\n")
    print(table(found, 1, ["label_flip", "backdoor"]))


if __name__ == "__main__":
    main()
