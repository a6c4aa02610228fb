"""Where a config's values come from: TOML files, the named presets (package data of
``fedmpi.presets``) and ``--set KEY=VALUE`` overrides; ``resolve`` puts them together."""

from __future__ import annotations

import copy
import dataclasses
import functools
import shlex
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError, did_you_mean
from .coerce import type_hints
from .paths import anchor_inputs
from .schema import ExperimentConfig, renamed, upgrade
from .toml import toml_value
from .validate import from_dict


def presets() -> list[str]:
    root = resources.files("fedmpi.presets")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def preset_description(name: str) -> str:
    """The first line of preset ``name``'s file, a ``# ...`` comment (``fedmpi presets``
    lists it): a comment, so that the config, and every run's bits, stay as they were."""
    _preset(name)   # an unknown name: the one-line error
    text = resources.files("fedmpi.presets").joinpath(f"{name}.toml").read_text()
    first = text.partition("\n")[0]
    return first[1:].strip() if first.startswith("#") else ""


def _read_toml(text: str, origin: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{origin}: not valid TOML ({exc})") from None
    except RecursionError:
        raise UsageError(f"{origin}: not valid TOML (arrays or tables nested too deeply)") from None


def load_preset(name: str) -> dict:
    return copy.deepcopy(_preset(name))


@functools.cache
def _preset(name: str) -> dict:
    """A preset is package data: read once (a sweep resolves it for each of its cells)."""
    if name not in presets():
        raise UsageError(f"preset {name!r} does not exist{did_you_mean(str(name), presets())}; "
                         f"available: {', '.join(presets())}")
    text = resources.files("fedmpi.presets").joinpath(f"{name}.toml").read_text()
    return _read_toml(text, f"preset {name}")


# A config is a few KB of TOML; past this it is something else (a results file, a device).
CONFIG_MAX_BYTES = 16 * 2 ** 20


def load_file(path: str | Path) -> dict:
    """A TOML config file; a missing, unreadable or binary one (a PNG, a results file) is
    a one-line UsageError that names the path. A UTF-8 byte order mark is skipped."""
    return read_toml_file(path, "config file")


def read_toml_file(path: str | Path, what: str) -> dict:
    """The TOML file ``path`` (``what``: "config file", "sweep file") as a dict; every way
    it can fail is a one-line UsageError that starts with ``what`` and the path."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory")
    if not path.exists():
        raise UsageError(f"{what} {path} does not exist")
    try:
        with open(path, "rb") as f:  # also a pipe: fedmpi run <(...)
            data = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise UsageError(f"{what} {path} is not a TOML text file (more than "
                         f"{CONFIG_MAX_BYTES // 2 ** 20} MiB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {path} is not a TOML text file (byte "
                         f"0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8)") from None
    if "\0" in text:  # valid UTF-8, but TOML forbids it: a binary file
        raise UsageError(f"{what} {path} is not a TOML text file (NUL byte at offset "
                         f"{data.index(0)})")
    text = text.removeprefix("\ufeff")  # the byte order mark some editors write
    return _read_toml(text, f"{what} {path}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.lr=0.1`` -> (["train", "lr"], 0.1); the value is read as a TOML value,
    and taken as a plain string when it is not one (``data.dataset=mnist``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=0.1")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError:
        raise UsageError(f"--set {key.strip()}=...: value nested too deeply") from None
    return key.strip().split("."), value


def refuse_spaced_value(overrides, positionals) -> None:
    """``--set train.lr 0.1`` (a space for the ``=``, or ``--set train.lr= 0.1``): the
    shell hands click ``0.1`` as the config file or an extra argument, which failed as
    "config file 0.1 does not exist". An ``--set`` without a value beside a positional
    that names no file is that mistake: say what was meant, in one line."""
    bare = [text for text in overrides if "=" not in text or text.endswith("=")]
    strays = [p for p in positionals if isinstance(p, str) and p and not _names_a_file(p)]
    if bare and strays:
        key = bare[0].rstrip("=").strip()
        raise UsageError(f"--set {key}: expected KEY=VALUE; did you mean "
                         f"--set {shlex.quote(f'{key}={strays[0]}')}?")


def _names_a_file(text: str) -> bool:
    return text.endswith((".toml", ".h5")) or Path(text).exists()


# The key that chooses what an open section's extra keys mean: changing it by an override
# drops the extras that came from the file or preset (they belonged to the old choice). For
# the algorithm that is every parameter, also one the new algorithm takes by the same name
# (FedACG's beta is not FedAvgM's): only those given by the same overrides stay.
_SELECTORS = {"partition": "kind", "algorithm": "name", "model": "name", "data": "dataset"}

# Where an algorithm parameter came from (``ExperimentConfig.algorithm_param_sources``).
DEFAULT, PRESET, FILE, COMMAND_LINE = "default", "preset", "config file", "command line"


def apply_overrides(values: dict, overrides: list[str], sources: dict | None = None,
                    notes: list | None = None) -> dict:
    """``--set`` on top of ``values``. ``--set partition.kind=pathological`` on a preset
    with ``alpha`` drops that alpha (and likewise model and dataset parameters); a new
    ``algorithm.name`` drops every algorithm parameter not given by ``overrides`` itself,
    and a new ``algorithm.base`` (FNR-FL) drops ``base_params``. ``sources`` (parameter ->
    where it came from) is updated; ``notes`` gets one line per dropped parameter that the
    new algorithm also takes (it now has its default, not the old algorithm's value)."""
    values = copy.deepcopy(upgrade(values))
    sources = {} if sources is None else sources
    notes = [] if notes is None else notes
    for text in overrides:
        path, value = parse_override(text)
        path = renamed(path)   # --set train.clip_norm=5 sets train.grad_clip
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"--set {text!r}: {part} is not a section")
        if len(path) == 2 and _SELECTORS.get(path[0]) == path[1] and node.get(path[1]) != value:
            if path[0] == "algorithm":
                _drop_algorithm_parameters(node, overrides, value, sources, notes)
            else:
                _drop_extras(path[0], node, overrides)
        if path == ["algorithm", "base"] and node.get("base", "fedavg") != value:
            _drop_base_params(node, overrides, value, sources, notes)
        node[path[-1]] = value
        if path[0] == "algorithm":
            if len(path) == 1:   # a whole [algorithm] table: its parameters are all it has
                sources.clear()
                sources.update({k: COMMAND_LINE for k in value if k not in _FIXED_ALGORITHM}
                               if isinstance(value, dict) else {})
            elif path[1] not in _FIXED_ALGORITHM:
                sources[path[1]] = COMMAND_LINE
    return values


def _given(section: str, overrides: list[str]) -> set[str]:
    """The keys of ``section`` that ``overrides`` set (``algorithm.base_params.mu``: base_params)."""
    return {p[1] for p in (parse_override(t)[0] for t in overrides) if len(p) >= 2 and p[0] == section}


def _drop_extras(section: str, node: dict, overrides: list[str]) -> None:
    cls = type_hints(ExperimentConfig)[section]
    fixed = {f.name for f in dataclasses.fields(cls)}
    given = _given(section, overrides)
    for key in [k for k in node if k not in fixed and k not in given]:
        del node[key]


_FIXED_ALGORITHM = {"name", "params"}


def _drop_algorithm_parameters(node: dict, overrides: list[str], name, sources: dict,
                               notes: list) -> None:
    """A new algorithm ``name``: the old one's parameters go, except those ``overrides``
    give; each that ``name`` also takes gets a note (it means something else there)."""
    old = node.get("name", "fedavg")
    given = _given("algorithm", overrides)
    defaults = _algorithm_defaults(name)
    for key in [k for k in node if k not in _FIXED_ALGORITHM and k not in given]:
        value = node.pop(key)
        sources.pop(key, None)
        if key in defaults:
            notes.append(f"algorithm.{key} = {_show(value)} was set for {old}; {name} uses its "
                         f"default {_show(defaults[key])} (set algorithm.{key} to override)")


def _drop_base_params(node: dict, overrides: list[str], base, sources: dict,
                      notes: list) -> None:
    """FNR-FL's ``base_params`` belong to its old ``base``: a new base drops them unless
    ``overrides`` give them too."""
    if "base_params" in node and "base_params" not in _given("algorithm", overrides):
        value = node.pop("base_params")
        sources.pop("base_params", None)
        if value:
            notes.append(f"algorithm.base_params = {_show(value)} was set for base "
                         f"{node.get('base', 'fedavg')}; {base} uses its defaults (set "
                         f"algorithm.base_params to override)")


def _show(value) -> str:
    try:
        return toml_value(list(value) if isinstance(value, tuple) else value)
    except Exception:   # noqa: BLE001 - a note must never fail the resolution
        return repr(value)


def _algorithm_defaults(name) -> dict:
    """Parameter -> default of algorithm ``name`` (empty if it is unknown, e.g. a typo)."""
    # deferred: fedmpi.algorithms imports this package and torch (validate.py says why)
    from ..algorithms import REGISTRY
    from ..algorithms.params import default_of

    cls = REGISTRY.get(name) if isinstance(name, str) else None
    return {f.name: default_of(f) for f in dataclasses.fields(cls.Params)} if cls else {}


def resolve(path: str | None = None, preset: str | None = None,
            overrides: list[str] = (), values: dict | None = None) -> ExperimentConfig:
    """File or preset (default preset ``default``), then ``--set`` overrides, validated.
    ``values`` (``fedmpi.run`` from Python) stands for a config file's contents; a file's
    relative input paths point from its folder (``paths.anchor_inputs``).

    The config also carries ``algorithm_param_sources`` (parameter -> "default", "preset",
    "config file" or "command line") and ``algorithm_notes`` (the lines saying which
    parameters a change of algorithm dropped; ``fedmpi`` prints them on rank 0)."""
    if sum(x is not None and x != "" for x in (path, preset, values)) > 1:
        raise UsageError("give a config file or --preset, not both")
    origin = FILE if path or values is not None else PRESET
    if path:
        values = anchor_inputs(load_file(path), path)
    elif values is None:
        values = load_preset(preset or "default")
    else:
        values = copy.deepcopy(values)
    table = values.get("algorithm")
    sources = ({k: origin for k in table if k not in _FIXED_ALGORITHM}
               if isinstance(table, dict) else {})
    notes: list[str] = []
    config = from_dict(apply_overrides(values, list(overrides), sources, notes))
    config.algorithm_param_sources = {k: sources.get(k, DEFAULT) for k in config.algorithm.params}
    config.algorithm_notes = notes
    return config
