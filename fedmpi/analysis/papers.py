"""The seed papers' table layouts: which runs are which row, what each column shows, and
the paper's own number beside ours where the setting matches (``paper_numbers``).

A layout names a paper's rows by the config keys that make a method (``algorithm.name``,
and for FedU^2's table the SSL backbone and the ablation switches), its columns by the
setting keys it varies (dataset, scale, heterogeneity), and the metrics a column shows:
the metrics of the paper's block whose setting the column's runs are in (FedACG's
accuracy at 500/1000 rounds and rounds to its targets), else the layout's own. Used by
``tools/paper_table.py --paper NAME``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedmpi.analysis.paper_numbers import BLOCKS, Block
from fedmpi.analysis.tables import _canonical, _hashable, _value_key, group_table
from fedmpi.config import flatten
from fedmpi.errors import UsageError

NAMES = {"fedavg": "FedAvg", "fedprox": "FedProx", "fedavgm": "FedAvgM", "fedadam": "FedADAM",
         "feddyn": "FedDyn", "moon": "MOON", "fedcm": "FedCM", "fedmlb": "FedMLB", "fedlc": "FedLC",
         "fedntd": "FedNTD", "feddc": "FedDC", "feddecorr": "FedDecorr", "fedacg": "FedACG",
         "fedexp": "FedExp", "scaffold": "SCAFFOLD", "mofedsam": "MoFedSAM", "fedmrur": "FedMRUR",
         "fedsam": "FedSAM", "fedmim": "FedMIM", "fednova": "FedNova", "fnrfl": "FNR-FL",
         "fedsimsiam": "FedSimsiam", "fedsimclr": "FedSimCLR", "fedbyol": "FedBYOL",
         "fedu": "FedU-BYOL", "fedema": "FedEMA-BYOL", "orchestra": "Orchestra"}
# the SSL methods whose paper name carries the client method they run on
ON_BACKBONE = {"fedu2": "FedU2", "feddecorr_ssl": "FedDecorr", "ldawa": "L-DAWA", "fedx": "FedX"}
BACKBONES = {"simsiam": "Simsiam", "simclr": "SimCLR", "byol": "BYOL"}


@dataclass(frozen=True)
class Layout:
    name: str
    title: str
    settings: tuple[str, ...]       # the column keys, in the paper's order
    metrics: tuple[str, ...]        # a column's metrics where no paper block matches it
    method_keys: tuple[str, ...] = ("algorithm.name",)
    smooth: float | None = None
    spelling: dict = field(default_factory=dict)   # this paper's own names, e.g. FedAdam

    def label(self, values: dict) -> str:
        """The paper's name of the method a group row's ``method_keys`` values make."""
        name = values.get("algorithm.name")
        if name in ON_BACKBONE:
            backbone = values.get("algorithm.backbone") or _default(name, "backbone")
            backbone = BACKBONES.get(backbone, str(backbone))
            base = ON_BACKBONE[name]
            if name == "fedu2" and values.get("algorithm.fur") == "none":
                base += "-FUR"      # the paper's "FedU^2-FUR": without FUR, EUA only
            elif name == "fedu2" and values.get("algorithm.aggregator") == "fedavg":
                base += "-EUA"      # without EUA, FUR only
            return f"{base}-{backbone}"
        return self.spelling.get(name, NAMES.get(name, str(name)))

    def blocks(self) -> list[Block]:
        return [b for b in BLOCKS if b.paper == self.name]


LAYOUTS = {layout.name: layout for layout in (
    Layout("fedacg", "FedACG (Kim et al., CVPR 2024), Table 1: EMA(0.9) accuracy at 500 and 1000 "
           "rounds, rounds to the targets",
           ("data.dataset", "clients.num", "clients.per_round", "partition.alpha"),
           ("acc@500", "acc@1000"), smooth=0.9),
    Layout("fedmrur", "FedMRUR (An et al., 2023), Table 2: final test accuracy",
           ("data.dataset", "clients.num", "partition.kind", "partition.alpha", "partition.n"),
           ("final_acc",)),
    Layout("fedmim", "FedMIM (2023), Table 1: test accuracy after the last round",
           ("data.dataset", "partition.kind", "partition.alpha"), ("final_acc",),
           spelling={"fedadam": "FedAdam"}),
    Layout("fnrfl", "FNR-FL (Hu et al., 2023), Tables 2-3: accuracy, traffic, time, kappa, rho "
           "(no paper numbers stored: the tables did not survive the text conversion)",
           ("data.dataset", "partition.kind", "partition.alpha", "partition.noise",
            "partition.quantity_alpha"),
           ("final_acc", "traffic_mb", "time_s", "kappa", "rho")),
    Layout("fedu2", "FedU^2 (Liao et al., CVPR 2024), Tables 1-2: kNN accuracy, linear probe, "
           "1%/10% fine-tuning",
           ("data.dataset", "clients.num", "clients.per_round", "partition.alpha"),
           ("final_acc", "linear_acc", "finetune_1pct_acc", "finetune_10pct_acc"),
           method_keys=("algorithm.name", "algorithm.backbone", "algorithm.fur", "algorithm.aggregator")),
)}


def _default(algorithm: str, param: str):
    """A parameter's default (a config that does not name it runs it)."""
    from fedmpi.algorithms import REGISTRY   # deferred: torch, which analysis does without

    return getattr(REGISTRY[algorithm].Params(), param, None) if algorithm in REGISTRY else None


def layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise UsageError(f"--paper {name!r}: allowed are {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def matching_blocks(layout_: Layout, runs) -> list[Block]:
    """The paper's blocks whose setting every one of ``runs`` is in."""
    return [b for b in layout_.blocks()
            if runs and all(_same(run.get(k), v) for run in runs for k, v in b.match.items())]


def column_metrics(layout_: Layout, blocks: list[Block], extra=()) -> list[str]:
    """What a column shows: its matching blocks' metrics in the paper's order, else the
    layout's own; then ``extra`` (the user's --at and --target)."""
    found = [m for b in blocks for m in b.metrics] or list(layout_.metrics)
    return list(dict.fromkeys(found + list(extra)))


def paper_value(blocks: list[Block], method: str, metric: str):
    """The paper's number for ``method`` and ``metric`` in these blocks, or None."""
    for b in blocks:
        if method in b.rows and metric in b.metrics:
            return b.rows[method][b.metrics.index(metric)]
    return None


def _same(ours, theirs) -> bool:
    if isinstance(theirs, (int, float)) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return float(ours) == float(theirs)
    return ours == theirs


@dataclass
class PaperTable:
    """Rows (the paper's method names) x columns (setting tuples), ``cells[(row, column)]``
    a ``group_table`` row; per column its metrics and the paper's blocks it matches."""

    settings: list[str]
    rows: list[str]
    columns: list[tuple]
    cells: dict
    metrics: dict            # column -> [metric]
    blocks: dict             # column -> [Block]
    method_keys: list[str]


def paper_table(runs, layout_: Layout, settings=None, at=(), targets=(), smooth=None) -> PaperTable:
    """The runs as ``layout_`` lays them out; ``settings`` (default: the layout's keys
    that differ among the runs, the dataset always) are the columns; ``at`` and
    ``targets`` add columns' metrics; ``smooth`` (default the layout's) smooths them."""
    known = set().union(*(flatten(run.config) for run in runs))
    method_keys = [k for k in layout_.method_keys if k in known]
    if settings is None:
        settings = [k for k in layout_.settings if k in known and
                    (k == "data.dataset" or len({_canonical(run.get(k)) for run in runs}) > 1)]
    by_column: dict[tuple, list] = {}
    for run in runs:
        by_column.setdefault(tuple(_hashable(run.get(k)) for k in settings), []).append(run)
    extra = [f"acc@{r}" for r in at] + [f"rounds_to_{t:g}" for t in targets]
    blocks = {c: matching_blocks(layout_, members) for c, members in by_column.items()}
    metrics = {c: column_metrics(layout_, blocks[c], extra) for c in by_column}
    every = {m for ms in metrics.values() for m in ms}
    rounds = sorted({int(m[4:]) for m in every if m.startswith("acc@")})
    goals = sorted({float(m[10:]) for m in every if m.startswith("rounds_to_")})
    grouped = group_table(runs, method_keys + settings, rounds, goals,
                          layout_.smooth if smooth is None else smooth)
    labels = _labels(layout_, grouped, method_keys)
    rows, cells, columns = [], {}, []
    for row, label in zip(grouped, labels):
        column = tuple(_hashable(row[k]) for k in settings)
        rows += [label] if label not in rows else []
        columns += [column] if column not in columns else []
        cells[(label, column)] = row
    columns.sort(key=lambda c: tuple(_value_key(v) for v in c))
    return PaperTable(settings, rows, columns, cells, metrics, blocks, method_keys)


def _labels(layout_: Layout, grouped: list[dict], method_keys: list[str]) -> list[str]:
    """The paper's name of each group row; two method groups one name would merge get
    the method keys that tell them apart, e.g. ``FedU2-BYOL (fur=code)``."""
    names = [layout_.label(row) for row in grouped]
    methods: dict[str, set] = {}
    for name, row in zip(names, grouped):
        methods.setdefault(name, set()).add(tuple(str(row[k]) for k in method_keys))
    out = []
    for name, row in zip(names, grouped):
        if len(methods[name]) > 1:
            variants = methods[name]
            differ = [k for i, k in enumerate(method_keys) if len({v[i] for v in variants}) > 1]
            name += " (" + ", ".join(f"{k.split('.')[-1]}={row[k]}" for k in differ) + ")"
        out.append(name)
    return out
