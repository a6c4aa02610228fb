"""Tuning studies: one TOML file describes a search over config fields with one budget
for every method; each trial is a fedmpi run with its own results file.

A study file::

    name = "fmnist-budget"         # optional: the study's folder; default: the file's stem
    preset = "default"             # the base: a preset, or
    # config = "base.toml"         # a config file, relative to the study file
    outdir = "runs"                # optional; trials in {outdir}/{name}/{method}/trial-NNNN.h5
    trials = 12                    # the budget: trials per method, the same for every method
    objective = "final_acc"        # or a list: ["final_acc", "up_mb"] (a Pareto front)
    sampler = "tpe"                # tpe | random
    pruner = "median"              # none | median | successive_halving | hyperband
    seed = 0                       # the sampler's seed (each method's study gets its own)
    # sampler_startup = 10         # TPE: random trials before it models (Optuna's default)
    # pruner_startup = 5           # median: trials that run to the end before any is pruned
    # pruner_warmup = 0            # median: rounds before a trial may be pruned

    [set]                          # the same overrides for every trial (as in a sweep)
    rounds = 30

    [space]                        # searched for every method
    "train.lr" = {low = 0.005, high = 0.5, log = true}

    [methods.fedavg]               # optional: each method's fixed fields and own space
    "algorithm.name" = "fedavg"
    [methods.fedprox]
    "algorithm.name" = "fedprox"
    space = {"algorithm.mu" = {low = 0.001, high = 1.0, log = true}}

**Dimensions.** ``{low, high}`` with both integers: an integer range; with a float among
them: a float range; ``log = true`` samples on a log scale (low > 0), ``step`` a grid of
that step. A list (``[32, 64]``) or ``{choices = [...]}``: a categorical choice.

**Objectives** (read from each trial's results file, fedmpi.analysis.metrics; the
direction is the metric's own): ``final_acc``, ``ema_acc`` (EMA 0.9, FedACG's
smoothing), ``best_acc`` (maximised); ``rounds_to:T`` (the first round at accuracy >= T,
inf if never), ``total_mb``, ``up_mb``, ``virtual_hours`` (minimised).

**Pruning** reads the test accuracy of every evaluation round (``eval.every``) of a
single-objective study; a pruned run stops at that round's end, its file marked
``pruned``. Without a ``[methods]`` table the study has one method, ``base``.

Everything is checked before any trial starts (``load``): every method's config is
resolved at the lowest point of its space, and a bad field, an empty or contradictory
space, an unknown objective or a pruner with no evaluation round to read is a one-line
``UsageError``. Nothing here imports Optuna (``fedmpi.tune_worker`` runs the study).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ExperimentConfig, read_toml_file, resolve, toml_value
from .errors import UsageError
from .sweep import base_of, dotted_table, string_field

STUDY_KEYS = ("name", "preset", "config", "outdir", "trials", "objective", "sampler", "pruner",
              "seed", "sampler_startup", "pruner_startup", "pruner_warmup", "set", "space",
              "methods")
SAMPLERS = ("tpe", "random")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
# objective -> (direction, what it is)
OBJECTIVES = {
    "final_acc": ("maximize", "the last evaluated test accuracy"),
    "ema_acc": ("maximize", "the last EMA(0.9) of the evaluated accuracies"),
    "best_acc": ("maximize", "the highest evaluated accuracy"),
    "rounds_to": ("minimize", "rounds to an accuracy target, rounds_to:T (inf if never)"),
    "total_mb": ("minimize", "FL MB down + up over the run"),
    "up_mb": ("minimize", "FL MB uploaded over the run"),
    "virtual_hours": ("minimize", "the simulated deployment's hours (system_model.profiles)"),
}
MAX_TRIALS = 10_000


@dataclass(frozen=True)
class Dimension:
    key: str                      # the dotted config field
    kind: str                     # int | float | choice
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: tuple = ()

    def lowest(self):
        """A point of the dimension, for checking the config before any trial."""
        return self.choices[0] if self.kind == "choice" else self.low


@dataclass(frozen=True)
class Method:
    name: str
    fixed: dict                   # dotted key -> value: [set], then the method's own
    space: tuple[Dimension, ...]  # [space], then the method's own


@dataclass(frozen=True)
class Study:
    path: Path
    name: str
    base: tuple[str, str]
    directory: Path               # {outdir}/{name}: the journal and every trial's file
    trials: int                   # per method
    objectives: tuple[str, ...]
    sampler: str
    pruner: str
    seed: int
    methods: tuple[Method, ...]
    extra: tuple[str, ...] = ()   # the command line's --set, after everything
    sampler_startup: int | None = None   # None: Optuna's default
    pruner_startup: int | None = None
    pruner_warmup: int = 0

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVES[o.partition(":")[0]][0] for o in self.objectives]

    @property
    def journal(self) -> Path:
        return self.directory / "study.journal"

    def method(self, name: str) -> Method:
        for method in self.methods:
            if method.name == name:
                return method
        raise UsageError(f"study {self.path}: no method {name!r}; it has "
                         f"{', '.join(m.name for m in self.methods)}")

    def output(self, method: Method, number: int) -> Path:
        return self.directory / method.name / f"trial-{number:04d}.h5"

    def overrides(self, method: Method, params: dict) -> list[str]:
        """``--set`` strings of one trial: the fixed fields, the sampled point, --set."""
        values = {**method.fixed, **params}
        return [f"{k}={toml_value(v)}" for k, v in values.items()] + list(self.extra)

    def config(self, method: Method, params: dict, output: Path) -> ExperimentConfig:
        kind, value = self.base
        lines = self.overrides(method, params) + [f"output={toml_value(str(output))}"]
        try:
            return resolve(value if kind == "config" else None,
                           value if kind == "preset" else None, lines)
        except UsageError as exc:
            raise UsageError(f"study {self.path}, method {method.name}: {exc}") from None


def load(path, *, outdir: str | None = None, overrides=()) -> Study:
    """Read and check a study file (see the module docstring)."""
    path = Path(path)
    values = read_toml_file(path, "study file")
    unknown = sorted(set(values) - set(STUDY_KEYS))
    if unknown:
        raise UsageError(f"study {path}: unknown key(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(STUDY_KEYS)}")
    base = base_of(path, values, "study")
    name = string_field(path, values, "name", path.stem, "study")
    if outdir is not None:
        values = dict(values, outdir=outdir)
    # absolute: a resumed trial runs from the folder it started in (api.resume_config)
    directory = Path(string_field(path, values, "outdir", "runs", "study")).expanduser().absolute() / name
    fixed = dotted_table(path, "set", values.get("set", {}), what="study")
    space = _space(path, "space", values.get("space", {}))
    extra = tuple(overrides)
    for text in extra:
        key = text.partition("=")[0].strip()
        if key == "output":
            raise UsageError(f"--set {text!r}: output is set per trial by study {path}")
    study = Study(path, name, base, directory, _trials(path, values.get("trials")),
                  _objectives(path, values.get("objective", "final_acc")),
                  _choice(path, values, "sampler", SAMPLERS, "tpe"),
                  _choice(path, values, "pruner", PRUNERS, "none"),
                  _seed(path, values.get("seed", 0)),
                  _methods(path, fixed, space, values.get("methods")), extra,
                  _count(path, values, "sampler_startup"), _count(path, values, "pruner_startup"),
                  _count(path, values, "pruner_warmup") or 0)
    _check(study)
    return study


def _trials(path, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TRIALS:
        raise UsageError(f"study {path}: trials must be an integer in 1..{MAX_TRIALS} (the "
                         f"budget of every method), got {value!r}")
    return value


def _count(path, values, key) -> int | None:
    value = values.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_TRIALS * 1000):
        raise UsageError(f"study {path}: {key} must be a non-negative integer, got {value!r}")
    return value


def _seed(path, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise UsageError(f"study {path}: seed must be an integer in 0..2^32-1, got {value!r}")
    return value


def _choice(path, values, key, allowed, default) -> str:
    value = values.get(key, default)
    if value not in allowed:
        raise UsageError(f"study {path}: {key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _objectives(path, value) -> tuple[str, ...]:
    names = value if isinstance(value, list) else [value]
    if not names or len(names) > 4:
        raise UsageError(f"study {path}: objective must be a name or a list of 1 to 4 names, "
                         f"got {value!r}")
    for name in names:
        head, _, target = name.partition(":") if isinstance(name, str) else ("", "", "")
        if head not in OBJECTIVES:
            raise UsageError(f"study {path}: objective {name!r} is unknown; allowed: "
                             f"{', '.join(OBJECTIVES)} (rounds_to:T with a target T in (0, 1])")
        if (head == "rounds_to") != bool(target):
            raise UsageError(f"study {path}: objective {name!r}: only rounds_to takes a target, "
                             f"and it needs one (rounds_to:0.8)")
        if target and not _fraction(target):
            raise UsageError(f"study {path}: objective {name!r}: the target must be an accuracy "
                             f"in (0, 1], e.g. rounds_to:0.8")
    if len(set(names)) != len(names):
        raise UsageError(f"study {path}: objective lists {value!r}: a name twice")
    return tuple(names)


def _fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def _methods(path, fixed: dict, space: tuple, table) -> tuple[Method, ...]:
    if table is None:
        return (Method("base", dict(fixed), space),)
    if not isinstance(table, dict) or not table:
        raise UsageError(f"study {path}: [methods] must be a table of methods, "
                         f"[methods.NAME] with its fields")
    methods = []
    for name, own in table.items():
        if not isinstance(own, dict) or not _safe_name(name):
            raise UsageError(f"study {path}: [methods.{name}] must be a table, and its name "
                             f"letters, digits, . _ + -")
        own = dict(own)
        extra = _space(path, f"methods.{name}.space", own.pop("space", {}))
        mine = dotted_table(path, f"methods.{name}", own, what="study")
        methods.append(Method(name, {**fixed, **mine}, space + extra))
    return tuple(methods)


def _safe_name(name: str) -> bool:
    return bool(name) and all(ch.isalnum() or ch in "._+-" for ch in name)


def _space(path, section: str, table) -> tuple[Dimension, ...]:
    if not isinstance(table, dict):
        raise UsageError(f"study {path}: [{section}] must be a table of fields, e.g. "
                         f"\"train.lr\" = {{low = 0.01, high = 0.3, log = true}}")
    return tuple(_dimension(path, section, key, spec) for key, spec in _leaves(table))


def _leaves(table: dict, prefix: str = ""):
    """Dotted keys down to a dimension: a list, or a table with low/high/choices."""
    for key, spec in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(spec, dict) and not ({"low", "high", "choices"} & set(spec)):
            yield from _leaves(spec, dotted + ".")
        else:
            yield dotted, spec


def _dimension(path, section, key, spec) -> Dimension:
    where = f"study {path}: [{section}] {key}"
    if isinstance(spec, list):
        spec = {"choices": spec}
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: give {{low = A, high = B}} (log = true, step = S optional) "
                         f"or a list of choices, got {spec!r}")
    unknown = sorted(set(spec) - {"low", "high", "log", "step", "choices"})
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: low, high, "
                         f"log, step, or choices")
    if "choices" in spec:
        choices = spec["choices"]
        if set(spec) != {"choices"} or not isinstance(choices, list) or not choices:
            raise UsageError(f"{where}: choices must be a non-empty list, alone")
        if len({toml_value(c) for c in choices}) != len(choices):
            raise UsageError(f"{where}: choices {choices!r} name a value twice")
        return Dimension(key, "choice", choices=tuple(choices))
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    numbers = [v for v in (low, high, step) if v is not None]
    if low is None or high is None or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                          for v in numbers):
        raise UsageError(f"{where}: low and high must both be numbers, got {spec!r}")
    if not all(math.isfinite(v) for v in numbers) or not low <= high:
        raise UsageError(f"{where}: needs finite low <= high, got low = {low!r}, high = {high!r}")
    if not isinstance(log, bool) or (log and (low <= 0 or step is not None)):
        raise UsageError(f"{where}: log = true needs low > 0 and no step, got {spec!r}")
    if step is not None and not 0 < step <= high - low:
        raise UsageError(f"{where}: step must be in (0, high - low], got {step!r}")
    kind = "int" if all(isinstance(v, int) for v in numbers) else "float"
    return Dimension(key, kind, low, high, log, step)


def _check(study: Study) -> None:
    """Every method's config at the lowest point of its space; the space, objectives and
    pruner against what the config can give."""
    single = len(study.objectives) == 1
    if study.pruner != "none" and not single:
        raise UsageError(f"study {study.path}: pruner {study.pruner!r} needs a single objective; "
                         f"a multi-objective study ({', '.join(study.objectives)}) takes "
                         f"pruner = \"none\"")
    for method in study.methods:
        keys = [d.key for d in method.space]
        if not keys:
            raise UsageError(f"study {study.path}: method {method.name} has an empty search "
                             f"space; give [space] or [methods.{method.name}] space = {{...}}")
        twice = sorted({k for k in keys if keys.count(k) > 1} | (set(keys) & set(method.fixed)))
        if twice:
            raise UsageError(f"study {study.path}: method {method.name}: {', '.join(twice)} both "
                             f"searched and set (or searched twice); keep one")
        if "output" in keys or "output" in method.fixed:
            raise UsageError(f"study {study.path}: output is set per trial; set outdir instead")
        for text in study.extra:
            key = text.partition("=")[0].strip()
            if key in keys:
                raise UsageError(f"--set {text!r}: {key} is searched by study {study.path}")
        config = study.config(method, {d.key: d.lowest() for d in method.space},
                              study.output(method, 0))
        _check_config(study, method, config)


def _check_config(study: Study, method: Method, config: ExperimentConfig) -> None:
    if study.pruner != "none" and config.eval.every >= config.rounds:
        raise UsageError(f"study {study.path}: method {method.name}: pruner {study.pruner!r} "
                         f"reads the accuracy of evaluation rounds before the last, and "
                         f"eval.every = {config.eval.every} with rounds = {config.rounds} "
                         f"leaves none; lower eval.every or set pruner = \"none\"")
    if "virtual_hours" in study.objectives and config.system_model.profiles == "off":
        raise UsageError(f"study {study.path}: method {method.name}: objective virtual_hours "
                         f"needs the virtual clock (system_model.profiles); it is off")
