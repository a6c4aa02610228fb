"""Algorithm parameters: each method's frozen Params dataclass declares its fields once,
with ``param(default, allowed, doc)``, and the base Params checks every value against its
range or choices in one message style (``config field algorithm.<name>: ...``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError


@dataclass(frozen=True)
class Params:
    """Base of every algorithm's frozen parameter dataclass: checks each field against the
    range ``param`` declared for it (a subclass with checks of its own calls
    ``super().__post_init__()`` first)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if "allowed" in f.metadata:
                check_param(f.name, getattr(self, f.name), f.metadata["allowed"],
                            integer=type(default_of(f)) is int)


def param(default, allowed=None, doc: str = ""):
    """A Params field: its default, the values it may take and its one-line doc.

    ``allowed`` is an interval, "[0, 1)", "(0, inf)", a bound, "> 0", ">= 1", or a tuple
    of the allowed values; None: anything of the default's type. A list or dict default
    becomes a factory.
    """
    metadata = {"doc": doc} if allowed is None else {"doc": doc, "allowed": allowed}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def param_error(name: str, message: str) -> UsageError:
    """The one message style of a bad parameter: ``config field algorithm.<name>: ...``."""
    return UsageError(f"config field algorithm.{name}: {message}")


def check_param(name: str, value, allowed, integer: bool = False) -> None:
    """``value`` of parameter ``name`` within ``allowed`` (see ``param``), else UsageError:
    ``config field algorithm.p: must be in [0, 1], got 1.5`` or
    ``config field algorithm.eua: 'x' is not allowed; choose one of code, paper``."""
    if isinstance(allowed, tuple):
        if value not in allowed:
            raise param_error(name, f"{value!r} is not allowed; choose one of "
                                    f"{', '.join(map(str, allowed))}")
        return
    number = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if number and _within(value, allowed):
        return
    text = f"in {allowed}" if allowed[0] in "[(" else allowed
    if not number:
        text = f"{'an integer' if integer else 'a number'} {text}"
    raise param_error(name, f"must be {text}, got {value if number else repr(value)}")


def _within(value, allowed: str) -> bool:
    """NaN is within nothing."""
    if allowed[0] in "[(":
        low, high = (float(bound) for bound in allowed[1:-1].split(","))  # host sync: none, config time
        above = low <= value if allowed[0] == "[" else low < value
        return above and (value <= high if allowed[-1] == "]" else value < high)
    op, bound = allowed.split()
    return value > float(bound) if op == ">" else value >= float(bound)  # host sync: none, config time


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def params_table(cls) -> list[tuple[str, Any, str]]:
    """(name, default, one-line doc) of each parameter, from the field metadata ``doc``."""
    return [(f.name, default_of(f), f.metadata.get("doc", "")) for f in dataclasses.fields(cls.Params)]
