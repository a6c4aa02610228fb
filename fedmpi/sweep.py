"""Sweeps: one TOML file describes a grid of experiments, one results file per cell.

A sweep file::

    name = "fmnist-skew"           # optional: the runs' subdirectory; default: the file's stem
    preset = "fedacg_fmnist"       # the base: a preset, or
    # config = "base.toml"         # a config file, relative to the sweep file
    outdir = "runs"                # optional; default "runs", relative to the working directory

    [set]                          # optional: the same overrides for every cell
    rounds = 50
    "train.lr" = 0.05              # dotted keys, quoted or as TOML tables: [set.train] lr = 0.05

    [grid]                         # the cells: the Cartesian product of these lists
    "algorithm.name" = ["fedavg", "fedacg"]
    "partition.alpha" = [0.1, 0.3]
    seed = [0, 1, 2]

**Order.** Cell ``i`` is the ``i``-th element of ``itertools.product`` over the grid
lists in the order the keys are written: the last key varies fastest. Above, cell 0 is
(fedavg, 0.1, 0), cell 1 is (fedavg, 0.1, 1), cell 3 is (fedavg, 0.3, 0), cell 6 is
(fedacg, 0.1, 0). The order depends only on the file, so a SLURM array task id names the
same cell every time the sweep is read.

**Names.** A cell is named by its grid values, ``key=value`` joined with ``,`` in grid
order, e.g. ``algorithm.name=fedacg,partition.alpha=0.3,seed=1``; its results file is
``{outdir}/{name}/{cell name}.h5``. In a value, any character outside
``A-Z a-z 0-9 . _ + -`` becomes ``_``; a list is written with ``-`` between its items
(``model.channels = [[4, 8]]`` -> ``model.channels=4-8``), a table as its ``name`` then
``key_value`` items (``algorithm=fedacg-lam_0.85``); names longer than 200 characters are
cut and end in ``~`` + 8 hex digits of their hash. Two cells whose names come out equal
are an error.

**Tables as grid values** replace the whole field: ``algorithm = [{name = "fedavg"},
{name = "fedacg", lam = 0.85}]`` sweeps algorithms together with their own parameters
(a preset's FedACG parameters would be unknown to FedAvg). A grid (or [set]) value of
``algorithm.name`` that differs from the base's algorithm drops the base's algorithm
parameters, also those the new algorithm has under the same name (FedACG's ``beta`` is
not FedAvgM's): each cell's algorithm gets its defaults, except the parameters the same
cell gives (its [set], grid values or ``--set``). In [set], tables merge key by
key instead. Because the name depends on the values, not on the cell's
index, a cell finds its own file again when the sweep is re-run, extended or reordered.

**A plain config file** (no ``preset``, ``config``, ``set`` or ``grid`` key) is a sweep
of one cell whose results file is the config's own ``output``; so every job template
can run one config or one cell of a sweep with the same resume-if-exists command.

**Validation.** ``load`` resolves every cell through ``fedmpi.config.resolve`` before
anything runs; the first bad cell is a one-line ``UsageError`` naming the sweep file,
the cell and the field. A grid of more than ``MAX_CELLS`` cells is refused before any.

**Re-running a cell** (``run_arguments``): no results file -> a fresh ``fedmpi run``;
a file with any status -> ``fedmpi run --resume FILE``, which continues an interrupted,
died (``running``) or failed run from its last checkpoint and does nothing for a
completed one. A sweep re-submitted after preemption, a time limit or a crash thus
finishes exactly the cells that are not finished.

A resume runs the config in the file, so a cell whose file holds another config than
the sweep now gives it (an edited [set], base config or preset: names follow the grid
values only) is refused, with the fields that differ (``config_changes``), rather than
resumed or called complete under the new config.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ExperimentConfig, flatten, read_toml_file, resolve
from .config import toml_value
from .config.since import as_started
from .errors import UsageError

SWEEP_KEYS = ("name", "preset", "config", "outdir", "set", "grid")
_SWEEP_MARKERS = ("preset", "config", "set", "grid")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
MAX_NAME = 200
# Every cell is resolved and checked whenever the sweep is read (each array task reads
# it), about 2.5 ms a cell: 100,000 cells take minutes. A larger grid is a slip (a list
# of a million seeds), or a search that belongs in several sweeps.
MAX_CELLS = 100_000


@dataclass(frozen=True)
class Cell:
    """One experiment of a sweep."""

    index: int
    values: tuple[tuple[str, Any], ...]   # the grid point: (dotted key, value) in grid order
    name: str                             # derived from ``values`` (see the module docstring)
    output: Path                          # its results file
    overrides: tuple[str, ...]            # ``--set`` strings: [set], the grid point, extra


@dataclass(frozen=True)
class Sweep:
    """A parsed, validated sweep file; ``cells[i]`` is cell ``i``."""

    path: Path
    name: str
    base: tuple[str, str]                 # ("preset", NAME) or ("config", PATH)
    fixed: dict[str, Any]                 # [set], dotted keys
    grid: dict[str, list]                 # [grid], dotted keys in file order
    cells: tuple[Cell, ...] = field(repr=False)
    single: bool = False                  # a plain config file: one cell, its own output

    def __len__(self) -> int:
        return len(self.cells)

    def cell(self, index: int) -> Cell:
        if not 0 <= index < len(self.cells):
            raise UsageError(f"sweep {self.path}: no cell {index}; it has {len(self.cells)} "
                             f"cell(s), 0..{len(self.cells) - 1}")
        return self.cells[index]

    def config(self, cell: Cell) -> ExperimentConfig:
        """The cell's resolved config (what ``fedmpi run`` would run)."""
        kind, value = self.base
        output = [] if self.single else [f"output={toml_value(str(cell.output))}"]
        try:
            return resolve(value if kind == "config" else None,
                           value if kind == "preset" else None, list(cell.overrides) + output)
        except UsageError as exc:
            raise UsageError(f"sweep {self.path}, cell {cell.index} ({cell.name}): {exc}") from None

    def fresh_arguments(self, cell: Cell) -> list[str]:
        """``fedmpi run`` arguments that start the cell from scratch."""
        kind, value = self.base
        args = [value] if kind == "config" else ["--preset", value]
        for text in cell.overrides:
            args += ["--set", text]
        return args if self.single else args + ["-o", str(cell.output)]


def load(path, *, outdir: str | None = None, overrides=()) -> Sweep:
    """Read and validate a sweep file (or a plain config file: one cell).

    ``overrides``: extra ``KEY=VALUE`` strings applied to every cell after [set] and
    the grid (the command line's ``--set``); ``outdir`` replaces the file's ``outdir``.
    """
    path = Path(path)
    values = _read(path)
    if not any(key in values for key in _SWEEP_MARKERS):
        return _single(path, outdir, list(overrides))
    unknown = sorted(set(values) - set(SWEEP_KEYS))
    if unknown:
        raise UsageError(f"sweep {path}: unknown key(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(SWEEP_KEYS)}")
    base = base_of(path, values)
    fixed = dotted_table(path, "set", values.get("set", {}))
    grid = dotted_table(path, "grid", values.get("grid", {}))
    name = string_field(path, values, "name", path.stem)
    if outdir is not None:
        values = dict(values, outdir=outdir)
    directory = Path(string_field(path, values, "outdir", "runs")).expanduser() / name
    extra = list(overrides)
    _check_keys(path, fixed, grid, extra)
    cells = tuple(_cells(path, fixed, grid, extra, directory))
    sweep = Sweep(path, name, base, fixed, grid, cells)
    _validate(sweep)
    return sweep


def run_arguments(sweep: Sweep, cell: Cell, force: bool = False) -> list[str]:
    """``fedmpi run`` arguments that bring ``cell`` to completion (see the module docstring)."""
    if cell.output.exists() and not force:
        return ["--resume", str(cell.output)]
    return sweep.fresh_arguments(cell) + (["--force"] if force else [])


def cell_state(sweep: Sweep, cell: Cell) -> tuple[str, list[str]]:
    """The cell's status (``missing`` or the file's: running | completed | failed |
    interrupted, or crashed: running, by a writer that is gone) and its
    ``config_changes``, from one read of its file."""
    if not cell.output.exists():
        return "missing", []
    from .results import RunFile, liveness   # deferred: h5py (~0.3 s), for a cell's file alone

    with RunFile(cell.output) as run:
        config = run.config
        as_started(config)   # a parameter newer than the file reads as what its rounds ran
        status, was = liveness.seen_status(run.status, run.attrs.get("writer")), flatten(config)
    now = flatten(json.loads(json.dumps(sweep.config(cell).to_dict())))
    return status, [f"{key} = {toml_value(was[key])} in the file, {toml_value(now[key])} now"
                    for key in sorted(was.keys() & now.keys())
                    if key != "output" and was[key] != now[key]]


def config_changes(sweep: Sweep, cell: Cell) -> list[str]:
    """How the config in the cell's results file differs from the one the sweep gives the
    cell now (an edited [set], base config or preset; ``--set``): one ``key = X in the
    file, Y now`` per field, [] without a file. Only fields both know are compared (another
    fedmpi version may have fields the other lacks); ``output`` is the cell's own."""
    return cell_state(sweep, cell)[1]


# ---- parsing ----------------------------------------------------------------------------

def _read(path: Path) -> dict:
    return read_toml_file(path, "sweep file")


def string_field(path: Path, values: dict, key: str, default: str, what: str = "sweep") -> str:
    value = values.get(key, default)
    if not isinstance(value, str) or not value:
        raise UsageError(f"{what} {path}: {key} must be a non-empty string, got {value!r}")
    if "{" in value or "}" in value:
        raise UsageError(f"{what} {path}: {key} may not contain braces, got {value!r}")
    return value


def base_of(path: Path, values: dict, what: str = "sweep") -> tuple[str, str]:
    if ("preset" in values) == ("config" in values):
        raise UsageError(f"{what} {path}: give exactly one base, preset = \"NAME\" or "
                         f"config = \"FILE\" (relative to the {what} file)")
    if "preset" in values:
        return "preset", string_field(path, values, "preset", "", what)
    config = path.parent / string_field(path, values, "config", "", what)
    if not config.is_file():
        raise UsageError(f"{what} {path}: config file {config} does not exist "
                         f"(config is relative to the {what} file)")
    return "config", str(config)


def dotted_table(path: Path, section: str, table, prefix: str = "", what: str = "sweep") -> dict[str, Any]:
    """``{"train": {"lr": 1}, "seed": [0]}`` -> ``{"train.lr": 1, "seed": [0]}``.

    In [grid] a table is always a section to descend into and a list is a key's values;
    in [set] a table is also descended into, so ``[set.train] lr = 0.1`` and
    ``"train.lr" = 0.1`` mean the same.
    """
    if not isinstance(table, dict):
        raise UsageError(f"{what} {path}: [{section}] must be a table of dotted keys")
    flat = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(dotted_table(path, section, value, dotted + ".", what))
        elif section == "grid" and (not isinstance(value, list) or not value):
            raise UsageError(f"sweep {path}: [grid] {dotted} must be a non-empty list of values, "
                             f"got {value!r}")
        else:
            flat[dotted] = value
    return flat


def _check_keys(path: Path, fixed: dict, grid: dict, extra: list[str]) -> None:
    if "output" in fixed or "output" in grid:
        raise UsageError(f"sweep {path}: output is set by the sweep ({{outdir}}/{{name}}/"
                         f"{{cell}}.h5); set outdir instead")
    both = sorted(set(fixed) & set(grid))
    if both:
        raise UsageError(f"sweep {path}: {', '.join(both)} in both [set] and [grid]")
    for text in extra:
        key = text.partition("=")[0].strip()
        if key in grid or key == "output":
            raise UsageError(f"--set {text!r}: {key} is set per cell by sweep {path}")


def _cells(path: Path, fixed: dict, grid: dict, extra: list[str], directory: Path):
    keys = list(grid)
    count = math.prod(len(values) for values in grid.values())
    if count > MAX_CELLS:
        sizes = " x ".join(f"{len(values)} {key}" for key, values in grid.items())
        raise UsageError(f"sweep {path}: the grid has {count} cells ({sizes}); at most "
                         f"{MAX_CELLS} are allowed, as each is checked whenever the sweep is "
                         f"read: split it into several sweeps")
    common = [f"{k}={toml_value(v)}" for k, v in fixed.items()]
    seen: dict[str, int] = {}
    for index, point in enumerate(itertools.product(*grid.values())):
        values = tuple(zip(keys, point))
        name = cell_name(values)
        if name in seen:
            raise UsageError(f"sweep {path}: cells {seen[name]} and {index} both get the name {name!r}; "
                             f"make their values differ in letters, digits or . _ + -")
        seen[name] = index
        overrides = common + [f"{k}={toml_value(v)}" for k, v in values] + extra
        yield Cell(index, values, name, directory / f"{name}.h5", tuple(overrides))


def cell_name(values) -> str:
    """``(("algorithm.name", "fedacg"), ("seed", 1))`` -> ``algorithm.name=fedacg,seed=1``."""
    if not values:
        return "base"
    name = ",".join(f"{key}={_format(value)}" for key, value in values)
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[:MAX_NAME - 9]}~{digest}"
    return name


def _format(value) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        text = "-".join(_format(v) for v in value)
    elif isinstance(value, dict):   # a table: its "name" plainly, the rest as key_value
        text = "-".join(_format(v) if k == "name" else f"{k}_{_format(v)}" for k, v in value.items())
    else:
        text = str(value)   # str(0.3) == "0.3", str(1e-05) == "1e-05"
    return _UNSAFE.sub("_", text)


def _single(path: Path, outdir, extra: list[str]) -> Sweep:
    """A plain config file as a sweep of one cell writing to the config's own output."""
    if outdir is not None:
        raise UsageError(f"{path} is a plain config file, not a sweep: --outdir applies to sweeps "
                         f"only; set its output field (--set output=PATH) instead")
    try:
        config = resolve(str(path), None, extra)
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    output = config.output_path()
    cell = Cell(0, (), output.stem, output, tuple(extra))
    return Sweep(path, path.stem, ("config", str(path)), {}, {}, (cell,), single=True)


def _validate(sweep: Sweep) -> None:
    for cell in sweep.cells:
        sweep.config(cell)
