"""Algorithms: one module per method, all through the protocol in ``base``.

``build(name, params)`` makes one from the config; ``REGISTRY`` lists them.
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from .base import REGISTRY, Algorithm, ClientTask, RoundContext, Upload, params_table, register


def _import_all() -> None:
    """Import every module of this package so each ``@register`` runs: adding an
    algorithm is adding a file."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_all()


def _lookup(name: str) -> type[Algorithm]:
    if name not in REGISTRY:
        raise UsageError(f"config field algorithm.name: {name!r} is not allowed; "
                         f"choose one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def resolved_params(name: str, params: dict, model_options: dict | None = None) -> dict:
    """Every parameter of ``name`` with its value: the given ones checked, the rest defaults;
    with ``model_options``, also what the method needs from the model."""
    algorithm = build(name, params)
    if model_options is not None:
        algorithm.check_model(model_options)
    return dataclasses.asdict(algorithm.params)


def message_sizes(cls: type[Algorithm]) -> str:
    """The declared per-client messages in units of d, e.g. 'down 2d, up d + 1'."""
    big = 10 ** 12
    parts = []
    for phase in cls.phases:
        down, up = cls().traffic(big, phase)
        label = f"{phase}: " if len(cls.phases) > 1 else ""
        parts.append(f"{label}down {_in_d(down, big)}, up {_in_d(up, big)}")
    return "; ".join(parts)


def _in_d(n: int, big: int) -> str:
    times, extra = divmod(n, big)
    text = {0: "", 1: "d"}.get(times, f"{times}d")
    if extra:
        text = f"{text} + {extra}" if text else str(extra)
    return text or "0"


def build(name: str, params: dict) -> Algorithm:
    """The algorithm ``name`` with ``params`` checked against its Params dataclass."""
    cls = _lookup(name)
    fields = {f.name: f for f in dataclasses.fields(cls.Params)}
    for key, value in params.items():
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise UsageError(f"config field algorithm.{key}: {name} has no such parameter; "
                             f"allowed: {allowed}")
        _check_type(f"algorithm.{key}", value, fields[key].default)
    return cls(cls.Params(**params))


def _check_type(field: str, value, default) -> None:
    """A parameter must have the type of its default (ints are accepted for floats)."""
    kind = type(default)
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise UsageError(f"config field {field}: expected {kind.__name__}, got {value!r}")


__all__ = ["REGISTRY", "Algorithm", "ClientTask", "RoundContext", "Upload", "build",
           "message_sizes", "params_table", "register", "resolved_params"]
