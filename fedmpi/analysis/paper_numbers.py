"""The seed papers' own numbers, as printed in their main tables, for ``fedmpi.analysis.papers``.

Each block is one column group of a paper's table: the setting it was measured in (config
values: a run matches when its config has every one), the metrics in the table's order
(``final_acc``, ``acc@R`` at round R, ``rounds_to_T`` to accuracy T, the /eval probes
``linear_acc`` and ``finetune_<p>pct_acc``), and one row per method in the paper's own
names. Accuracies are in percent as printed; rounds are integers, and "1000+" (FedACG) or
"inf" (FedMRUR's ∞) mark a target not reached within the paper's horizon.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    paper: str
    source: str                   # "Table 1a, CIFAR-10"
    match: dict                   # config key -> value the runs must have
    metrics: tuple[str, ...]
    rows: dict[str, tuple]        # the paper's method name -> one value per metric


def _block(paper, source, match, metrics, text) -> Block:
    rows = {}
    for line in text.strip().splitlines():
        name, *values = line.split()
        if len(values) != len(metrics):
            raise ValueError(f"{paper} {source} {name}: {len(values)} values for {len(metrics)} metrics")
        rows[name] = tuple(_value(v) for v in values)
    return Block(paper, source, dict(match), tuple(metrics), rows)


def _value(text: str):
    if text.endswith("+") or text == "inf":
        return text
    return float(text) if "." in text else int(text)


# ---- FedACG (Kim et al., CVPR 2024), Table 1: EMA(0.9) accuracy at 500/1000 rounds and
# rounds to two targets; ResNet-18-GN, Dir(0.3), (a) 100 clients at 5%, (b) 500 at 2%.
_ACG_ROWS = ("FedAvg", "FedProx", "FedAvgM", "FedADAM", "FedDyn", "MOON", "FedCM", "FedMLB",
             "FedLC", "FedNTD", "FedDC", "FedDecorr", "FedACG")
_ACG_A = """
74.36 82.53 840 1000+ 41.88 47.83 924 1000+ 33.94 35.37 645 1000+
73.70 82.68 826 1000+ 42.43 48.32 881 1000+ 34.14 35.53 613 1000+
80.56 85.48 519 828 46.98 53.29 515 1000+ 36.32 38.51 416 829
72.33 81.73 908 1000+ 44.80 52.48 691 1000+ 33.22 38.91 658 945
84.82 88.10 392 646 48.38 55.79 424 883 37.35 41.18 344 573
83.32 86.30 371 686 53.15 58.37 284 640 36.62 40.33 410 627
78.92 83.71 624 1000+ 52.44 58.06 293 747 31.61 37.87 694 1000+
74.98 84.04 714 1000+ 47.39 54.58 490 1000+ 37.20 40.16 415 539
78.37 84.79 680 1000+ 42.74 47.23 980 1000+ 35.03 35.95 500 1000+
76.05 83.78 685 1000+ 43.22 49.29 721 1000+ 33.91 37.33 547 1000+
86.52 87.47 323 519 54.25 59.01 333 553 40.32 45.51 340 403
76.62 83.40 728 1000+ 43.52 49.17 767 1000+ 33.40 34.86 1000+ 1000+
85.13 89.10 319 450 55.79 62.51 260 409 42.26 46.31 226 331
"""
_ACG_B = """
58.74 71.45 1000+ 1000+ 30.16 38.11 842 1000+ 23.63 29.48 523 1000+
57.88 70.75 1000+ 1000+ 29.28 36.16 966 1000+ 25.45 31.71 445 799
65.85 77.49 753 959 31.80 40.54 724 955 26.75 33.26 386 687
61.53 69.94 1000+ 1000+ 24.56 34.36 1000+ 1000+ 21.88 28.08 648 1000+
65.49 77.92 732 936 31.58 41.01 691 927 24.35 29.54 483 1000+
69.15 78.06 617 872 33.51 42.41 601 828 26.69 31.81 382 741
69.27 76.57 742 1000+ 27.23 38.79 872 1000+ 19.41 24.09 975 1000+
58.68 71.38 1000+ 1000+ 32.30 42.61 643 803 28.39 33.67 382 579
60.16 70.10 1000+ 1000+ 29.58 36.78 936 1000+ 22.14 26.83 676 1000+
60.65 73.20 991 1000+ 28.95 36.31 995 1000+ 24.67 32.16 475 800
71.86 83.49 518 686 34.64 45.93 569 741 25.72 28.92 420 1000+
60.01 72.83 1000+ 1000+ 30.56 38.20 850 1000+ 24.34 30.28 499 959
73.61 82.80 484 605 35.68 48.40 505 616 31.47 38.48 246 447
"""


def _split(text: str, names, width: int, groups: int) -> list[str]:
    """A printed multi-column table as one text per column group."""
    lines = [line.split() for line in text.strip().splitlines()]
    return ["\n".join(f"{name} {' '.join(values[g * width:(g + 1) * width])}"
                      for name, values in zip(names, lines)) for g in range(groups)]


def _fedacg() -> list[Block]:
    out = []
    for part, text, (num, per_round), targets in (
            ("a", _ACG_A, (100, 5), ((81, 85), (47, 55), (35, 38))),
            ("b", _ACG_B, (500, 10), ((73, 77), (36, 40), (24, 30)))):
        columns = _split(text, _ACG_ROWS, 4, 3)
        for (dataset, label), (low, high), column in zip(
                (("cifar10", "CIFAR-10"), ("cifar100", "CIFAR-100"), ("tiny_imagenet", "Tiny-ImageNet")),
                targets, columns):
            match = {"data.dataset": dataset, "clients.num": num, "clients.per_round": per_round,
                     "partition.kind": "dirichlet", "partition.alpha": 0.3}
            out.append(_block("fedacg", f"Table 1{part}, {label}", match,
                              ("acc@500", "acc@1000", f"rounds_to_{low / 100:g}",
                               f"rounds_to_{high / 100:g}"), column))
    return out


# ---- FedMRUR (An et al., 2023), Table 2: final test accuracy, CIFAR-100 (200 clients at 5%)
# and Tiny-ImageNet (500 at 2%), Dir(0.6), Dir(0.3), Path(20/80), Path(10/40).
_MRUR_ROWS = ("FedAvg", "FedExp", "FedProx", "SCAFFOLD", "FedCM", "MoFedSAM", "FedMRUR")
_MRUR = """
39.87 39.50 38.47 36.67 30.78 30.64 31.62 31.18
44.51 44.26 43.58 41.00 33.49 32.68 33.65 33.39
39.89 39.86 38.82 37.15 30.93 31.05 32.09 31.77
47.51 46.47 46.23 42.45 37.14 36.22 37.48 35.32
51.01 50.93 50.58 50.03 41.37 40.21 40.93 40.46
52.96 52.81 52.32 51.87 42.36 42.29 42.52 41.58
55.81 55.49 55.21 53.69 45.54 45.41 45.42 45.71
"""


def _fedmrur() -> list[Block]:
    out = []
    columns = _split(_MRUR, _MRUR_ROWS, 1, 8)
    for i, column in enumerate(columns):
        dataset, label, num = (("cifar100", "CIFAR-100", 200), ("tiny_imagenet", "Tiny-ImageNet", 500))[i // 4]
        split = [{"partition.kind": "dirichlet", "partition.alpha": 0.6},
                 {"partition.kind": "dirichlet", "partition.alpha": 0.3},
                 {"partition.kind": "pathological", "partition.n": 20 if i < 4 else 80},
                 {"partition.kind": "pathological", "partition.n": 10 if i < 4 else 40}][i % 4]
        match = {"data.dataset": dataset, "clients.num": num, **split}
        out.append(_block("fedmrur", f"Table 2, {label}", match, ("final_acc",), column))
    return out


# ---- FedMIM (2023), Table 1: test accuracy after 1000 rounds, 100 clients at 10%, E 5,
# B 50; IID, Dir(0.3), Dir(0.1).
_MIM_ROWS = ("FedAvg", "FedAdam", "SCAFFOLD", "FedCM", "FedDyn", "FedSAM", "FedMIM")
_MIM = """
82.16 80.19 75.92 42.77 42.18 40.88 30.31 28.61 27.93
83.19 78.61 71.75 48.92 44.58 42.96 37.04 32.34 29.44
84.43 82.39 78.78 49.11 48.34 46.93 35.09 34.68 34.17
85.62 82.57 77.31 51.14 49.27 45.59 34.35 33.34 32.34
84.23 81.44 75.66 46.87 45.77 43.93 33.91 31.97 30.11
84.98 82.13 77.65 48.32 46.24 44.18 35.04 33.15 32.86
86.39 84.39 80.82 52.83 50.53 49.20 36.47 35.17 34.83
"""


def _fedmim() -> list[Block]:
    out = []
    for i, column in enumerate(_split(_MIM, _MIM_ROWS, 1, 9)):
        dataset, label = (("cifar10", "CIFAR-10"), ("cifar100", "CIFAR-100"),
                          ("tiny_imagenet", "Tiny-ImageNet"))[i // 3]
        split = ({"partition.kind": "iid"}, {"partition.kind": "dirichlet", "partition.alpha": 0.3},
                 {"partition.kind": "dirichlet", "partition.alpha": 0.1})[i % 3]
        match = {"data.dataset": dataset, "clients.num": 100, "clients.per_round": 10, **split}
        out.append(_block("fedmim", f"Table 1, {label}", match, ("final_acc",), column))
    return out


# ---- FedU^2 (Liao et al., CVPR 2024). Table 1: linear probe and 1%/10% fine-tuning at
# Dir(0.1), cross-device (K = 100) and cross-silo (K = 10); Table 2: kNN accuracy,
# cross-silo, Dir(0.1/0.5/5), every method on BYOL. "FedU2-FUR-BYOL" is FedU^2 without
# FUR (EUA only), "FedU2-EUA-BYOL" without EUA (FUR only).
_U2_T1_ROWS = ("FedSimsiam", "FedDecorr-Simsiam", "FedU2-Simsiam", "FedSimCLR", "L-DAWA-SimCLR",
               "FedX-SimCLR", "FedU2-SimCLR", "FedBYOL", "FedU-BYOL", "FedEMA-BYOL", "Orchestra",
               "FedU2-BYOL")
_U2_T1 = """
60.49 44.45 70.46 70.61 57.60 69.88 31.91 12.58 37.33 49.81 21.64 43.08
43.18 35.15 58.68 74.56 65.21 80.10 17.09 5.36 20.60 47.93 20.53 45.21
68.50 56.43 75.33 84.92 77.11 85.21 35.59 13.08 38.22 56.55 31.42 48.75
65.76 51.18 68.33 75.65 62.86 76.15 37.09 11.73 31.97 51.62 19.47 41.60
65.63 49.66 69.89 75.48 63.4 78.66 41.28 13.52 36.56 51.11 21.07 45.02
67.33 49.96 70.18 78.29 65.03 79.43 38.11 11.18 33.96 51.67 19.65 42.38
66.49 51.77 70.76 82.37 69.84 82.39 41.56 14.32 36.90 56.56 26.11 47.99
61.46 54.36 74.01 83.29 74.04 81.40 28.27 10.43 34.90 48.78 19.79 42.82
60.15 53.53 74.62 82.33 69.24 83.37 28.09 10.46 36.06 58.02 28.38 48.12
62.27 54.91 74.76 82.17 71.37 83.78 28.40 10.63 35.62 57.25 30.03 50.33
38.66 41.62 62.97 83.53 78.44 85.40 17.91 6.96 23.40 51.31 26.36 48.85
67.62 54.74 74.93 85.58 78.64 86.24 38.09 13.16 36.87 59.71 34.83 53.87
"""
_U2_T2_ROWS = ("FedBYOL", "FedU-BYOL", "FedEMA-BYOL", "FedDecorr-BYOL", "L-DAWA-BYOL", "FedX-BYOL",
               "Orchestra", "FedU2-FUR-BYOL", "FedU2-EUA-BYOL", "FedU2-BYOL")
_U2_T2 = """
76.12 77.23 82.71 38.13 43.93 45.30
79.09 79.68 82.75 51.31 51.81 52.05
80.32 82.01 82.80 53.18 53.18 53.28
76.76 79.66 81.09 49.87 49.54 52.07
65.40 66.17 82.82 23.09 51.10 52.25
50.94 40.96 41.05 15.83 16.35 16.89
79.25 76.78 76.30 38.52 37.17 34.93
81.04 82.18 83.45 53.45 53.86 54.34
80.93 82.14 84.01 53.20 53.72 54.61
81.39 82.21 84.79 53.87 54.07 55.06
"""
_PROBES = ("linear_acc", "finetune_1pct_acc", "finetune_10pct_acc")


def _fedu2() -> list[Block]:
    out = []
    datasets = (("cifar10", "CIFAR-10"), ("cifar100", "CIFAR-100"))
    for i, column in enumerate(_split(_U2_T1, _U2_T1_ROWS, 3, 4)):
        (dataset, label), k = datasets[i // 2], (100, 10)[i % 2]
        match = {"data.dataset": dataset, "clients.num": k, "partition.kind": "dirichlet",
                 "partition.alpha": 0.1}
        out.append(_block("fedu2", f"Table 1, {label}, K = {k}", match, _PROBES, column))
    for i, column in enumerate(_split(_U2_T2, _U2_T2_ROWS, 1, 6)):
        (dataset, label), alpha = datasets[i // 3], (0.1, 0.5, 5.0)[i % 3]
        match = {"data.dataset": dataset, "clients.num": 10, "partition.kind": "dirichlet",
                 "partition.alpha": alpha}
        out.append(_block("fedu2", f"Table 2, {label}, alpha = {alpha:g}", match, ("final_acc",), column))
    return out


BLOCKS: list[Block] = _fedacg() + _fedmrur() + _fedmim() + _fedu2()
