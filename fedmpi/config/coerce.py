"""TOML values -> the dataclasses of ``schema``: each fixed field checked against its
annotated type (no silent str -> number guessing), unknown keys refused outside the open
sections, and ``check_scalar``, the bounds every value of a config keeps (finite numbers,
integers in int64 range, no control characters)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, get_type_hints

from ..errors import UsageError, did_you_mean
from .schema import OPEN_SECTIONS, ExperimentConfig


# Integers end up in numpy and torch int64 arithmetic (sizes, counts, rounds, products of
# them); past 2**62 that overflows or crashes somewhere, so a bigger one is refused here.
INT_MAX = 2 ** 62
# The seed keys numpy SeedSequence (any size) and is stored as the results file's integer
# attribute "seed", which HDF5 holds as int64 or uint64: 2**64 - 1 is the largest it takes.
SEED_MAX = 2 ** 64 - 1
# Tighter caps where the consumer is smaller than int64: torch.set_num_threads takes a C
# int and every thread its stack (100000 threads crash start-up); crop_padding pads every
# image of a batch to (side + 2 p)^2 pixels.
_INT_CAPS = {"system.threads": (1024, "torch threads per rank; 0 = cores / ranks"),
             "data.crop_padding": (1024, "zero padding on each side before the random crop")}


def field_error(field_name: str, message: str) -> UsageError:
    return UsageError(f"config field {field_name}: {message}")


def check_scalar(field_name: str, value: Any, allow_inf: bool = False, inf_hint: str = "") -> None:
    """Every value of a config, open sections included, recursively through lists and
    tables: numbers finite (NaN never; infinity only with ``allow_inf``, ``inf_hint`` says
    where it is allowed instead), integers within [-2**62, 2**62] (``seed``: [0, 2**64 - 1]),
    strings free of control characters (NUL cuts a path short, a newline splits messages)
    and of bytes that are not UTF-8 (a file name in another encoding)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if field_name == "seed":
            if not 0 <= value <= SEED_MAX:
                raise field_error("seed", f"must be an integer in [0, 2**64 - 1] = [0, {SEED_MAX}], "
                                          f"got {value}")
            return
        cap, what = _INT_CAPS.get(field_name, (INT_MAX, ""))
        if abs(value) > cap:
            sign = "" if value > 0 else "-"
            bound = ("at most " if value > 0 else "at least ") + \
                (f"{sign}2**62 = {sign}{INT_MAX}" if cap == INT_MAX else f"{sign}{cap}")
            raise field_error(field_name, f"must be {bound}{f' ({what})' if what else ''}, got {value}")
    elif isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            allowed = "a number (inf allowed)" if allow_inf else "a finite number"
            raise field_error(field_name, f"must be {allowed}, got {value}{inf_hint}")
    elif isinstance(value, str):
        bad = next((ch for ch in value if ord(ch) < 32 or ord(ch) == 127), None)
        if bad is not None:
            raise field_error(field_name, f"must not contain control characters, got {value!r}")
        if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):   # undecodable bytes (argv, paths)
            raise field_error(field_name, f"must be UTF-8 text (the results file stores it as "
                                          f"such), got {value!r}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_scalar(field_name, item, allow_inf, inf_hint)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_scalar(f"{field_name}.{key}", item, allow_inf, inf_hint)


def _coerce(field_name: str, value: Any, kind) -> Any:
    """Check one scalar against its annotated type (no silent str->number guessing)."""
    optional = kind == (str | None)
    if optional and (value is None or value == ""):   # TOML has no null: "" unsets a path
        return None
    if kind == list[float]:
        if not isinstance(value, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise field_error(field_name, f"expected a list of numbers, got {value!r}")
        return [_float(field_name, v) for v in value]
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise field_error(field_name, f"expected a list of strings, got {value!r}")
        return value
    if kind == (int | str):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise field_error(field_name, f"expected an integer or a string, got {value!r}")
        return value
    base = str if optional else kind
    if base is bool:
        if not isinstance(value, bool):
            raise field_error(field_name, f"expected true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise field_error(field_name, f"expected an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise field_error(field_name, f"expected a number, got {value!r}")
        return _float(field_name, value)
    if not isinstance(value, str):
        raise field_error(field_name, f"expected a string, got {value!r}")
    return value


def _float(field_name: str, value: int | float) -> float:
    """A number as a float; an integer too large for one (10**400) is not a finite number."""
    try:
        return float(value)
    except OverflowError:
        raise field_error(field_name, f"must be a finite number, got {value}") from None


@functools.cache
def type_hints(cls) -> dict:
    """The section's field types; resolving its string annotations is most of a config's
    validation time, and a sweep validates thousands of configs."""
    return get_type_hints(cls)


def build(cls, values: dict, prefix: str):
    """The dataclass ``cls`` from a TOML table, sections recursively (``prefix``: the
    dotted path, for messages); an open section's unknown keys go to its open field."""
    hints = type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    open_field = OPEN_SECTIONS.get(prefix.rstrip("."))
    known, extra = {}, {}
    for key, value in values.items():
        if key in names and key != open_field and dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise field_error(prefix + key, "expected a table (section)")
            known[key] = build(hints[key], value, f"{key}.")
        elif key in names and key != open_field:
            known[key] = _coerce(prefix + key, value, hints[key])
        elif open_field:
            extra[key] = value
        else:
            allowed = ", ".join(sorted(names))
            hint = did_you_mean(prefix + key, field_paths())
            raise field_error(prefix + key, f"unknown key{hint}; allowed: {allowed}")
    if open_field:
        known[open_field] = extra
    return cls(**known)


@functools.cache
def field_paths() -> tuple[str, ...]:
    """Every section and fixed field of a config as a dotted path (``train``, ``train.lr``,
    ``seed``): what an unknown key is matched against (``--set lr=0.1`` -> ``train.lr``)."""
    paths = []
    for top in dataclasses.fields(ExperimentConfig):
        paths.append(top.name)
        section = type_hints(ExperimentConfig)[top.name]
        if dataclasses.is_dataclass(section):
            paths += [f"{top.name}.{f.name}" for f in dataclasses.fields(section)
                      if f.name != OPEN_SECTIONS.get(top.name)]
    return tuple(paths)


def positive(name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise field_error(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def one_of(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise field_error(name, f"{value!r} is not allowed{did_you_mean(str(value), allowed)}; "
                                f"choose one of {', '.join(sorted(allowed))}")
