"""Where a config's values come from: TOML files, the named presets (package data of
``fedmpi.presets``) and ``--set KEY=VALUE`` overrides; ``resolve`` puts them together."""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

from ..errors import UsageError
from .schema import ExperimentConfig
from .validate import from_dict


def presets() -> list[str]:
    root = resources.files("fedmpi.presets")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def _read_toml(text: str, origin: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{origin}: not valid TOML ({exc})") from None
    except RecursionError:
        raise UsageError(f"{origin}: not valid TOML (arrays or tables nested too deeply)") from None


def load_preset(name: str) -> dict:
    if name not in presets():
        raise UsageError(f"preset {name!r} does not exist; available: {', '.join(presets())}")
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


# The key that chooses what an open section's extra keys mean: changing it on the command
# line drops the extras that came from the file or preset (they belonged to the old choice),
# except algorithm parameters the new algorithm also takes (the SSL heads, SAM's rho, ...).
_SELECTORS = {"partition": "kind", "algorithm": "name", "model": "name", "data": "dataset"}


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """``--set`` on top of ``values``. ``--set partition.kind=pathological`` on a preset
    with ``alpha`` drops that alpha (and likewise model and dataset parameters, and the
    algorithm parameters the new algorithm does not take); parameters given by other
    ``--set``s are kept."""
    values = copy.deepcopy(values)
    for text in overrides:
        path, value = parse_override(text)
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"--set {text!r}: {part} is not a section")
        if len(path) == 2 and _SELECTORS.get(path[0]) == path[1] and node.get(path[1]) != value:
            _drop_extras(path[0], node, overrides, value)
        node[path[-1]] = value
    return values


def _drop_extras(section: str, node: dict, overrides: list[str], choice) -> None:
    cls = get_type_hints(ExperimentConfig)[section]
    fixed = {f.name for f in dataclasses.fields(cls)}
    given = {p[1] for p in (parse_override(t)[0] for t in overrides) if len(p) == 2 and p[0] == section}
    shared = _algorithm_parameters(choice) if section == "algorithm" else set()
    for key in [k for k in node if k not in fixed and k not in given and k not in shared]:
        del node[key]


def _algorithm_parameters(name) -> set[str]:
    """The parameters algorithm ``name`` takes (none if it is unknown, e.g. a plugin's)."""
    from ..algorithms import REGISTRY

    cls = REGISTRY.get(name) if isinstance(name, str) else None
    return {f.name for f in dataclasses.fields(cls.Params)} if cls else set()


def resolve(path: str | None = None, preset: str | None = None,
            overrides: list[str] = ()) -> ExperimentConfig:
    """File or preset (default preset ``default``), then ``--set`` overrides, validated."""
    if path and preset:
        raise UsageError("give a config file or --preset, not both")
    values = load_file(path) if path else load_preset(preset or "default")
    return from_dict(apply_overrides(values, list(overrides)))
