"""Algorithms: one module per method, all through the protocol in ``base``.

``build(name, params)`` makes one from the config; ``REGISTRY`` lists them.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re

from ..config import check_scalar
from ..config.coerce import field_paths
from ..errors import UsageError, did_you_mean
from .base import (REGISTRY, Algorithm, ClientTask, RoundContext, Upload, keeps_private_layers,
                   register)
from .params import default_of, params_table


def _import_all() -> None:
    """Import every module of this package so each ``@register`` runs: adding an
    algorithm is adding a file."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_all()


def _lookup(name: str) -> type[Algorithm]:
    if name not in REGISTRY:
        raise UsageError(f"config field algorithm.name: {name!r} is not allowed"
                         f"{did_you_mean(str(name), REGISTRY)}; "
                         f"choose one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def resolved_params(name: str, params: dict, model_options: dict | None = None,
                    train=None) -> dict:
    """Every parameter of ``name`` with its value: the given ones checked, the rest defaults;
    with ``model_options``, also what the method needs from the model, and with ``train``
    (a TrainConfig) that its formulas hold for the local optimizer."""
    algorithm = build(name, params)
    if model_options is not None:
        algorithm.check_model(model_options)
    if train is not None:
        algorithm.check_training(train)
    return dataclasses.asdict(algorithm.params)


def message_sizes(cls: type[Algorithm]) -> str:
    """The declared per-client messages in units of d, e.g. 'down 2d, up d + 1'."""
    big = 10 ** 12
    parts = []
    for phase in cls.phases:
        down, up = cls().traffic(big, phase)
        label = f"{phase}: " if len(cls.phases) > 1 else ""
        parts.append(f"{label}down {_in_d(down, big)}, up {_in_d(up, big)}")
    if keeps_private_layers(cls):   # fedmpi.runtime.partial
        shared = re.sub(r"\bd\b", "d_shared", "; ".join(parts))
        return f"{shared} (the layers not kept on the clients)"
    return "; ".join(parts)


def _in_d(n: int, big: int) -> str:
    times, extra = divmod(n, big)
    text = {0: "", 1: "d"}.get(times, f"{times}d")
    if extra:
        text = f"{text} + {extra}" if text else str(extra)
    return text or "0"


# The parameters that take infinity, (algorithm, parameter) -> what it means; every other
# number must be finite, and NaN never is a parameter. A plugin may add its own.
INFINITE_PARAMS: dict[tuple[str, str], str] = {
    ("fedu", "mu"): "always the global predictor, i.e. FedBYOL",
}


def build(name: str, params: dict) -> Algorithm:
    """The algorithm ``name`` with ``params`` checked against its Params dataclass."""
    cls = _lookup(name)
    fields = {f.name: f for f in dataclasses.fields(cls.Params)}
    values = {}
    for key, value in params.items():
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            hint = did_you_mean(f"algorithm.{key}", [f"algorithm.{f}" for f in fields]
                                + list(field_paths()))   # algorithm.lr: train.lr
            raise UsageError(f"config field algorithm.{key}: {name} has no such parameter{hint}; "
                             f"allowed: {allowed}")
        values[key] = _checked(f"algorithm.{key}", value, default_of(fields[key]))
        _finite(name, key, values[key])
    return cls(cls.Params(**values))


def _finite(name: str, key: str, value) -> None:
    """Numbers finite and integers in int64 range (config.check_scalar), through lists;
    infinity only where INFINITE_PARAMS lists it. A table parameter (FNR-FL's base_params)
    is checked by the build it is passed to."""
    if isinstance(value, dict):
        return
    allowed = (name, key) in INFINITE_PARAMS
    hint = "" if allowed else "; inf only for " + ", ".join(
        f"{a}'s algorithm.{p} ({meaning})" for (a, p), meaning in INFINITE_PARAMS.items())
    check_scalar(f"algorithm.{key}", value, allow_inf=allowed, inf_hint=hint)


def _checked(field: str, value, default):
    """A parameter must have the type of its default. Config files have no tuples and
    ints for floats are fine: a list becomes a tuple (its elements are the Params
    class's to check), an int a float; a table is a dict parameter. A None default is
    an optional number (the Params class fills it in from other fields)."""
    kind = float if default is None else type(default)
    if kind is tuple and isinstance(value, (list, tuple)):
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)  # host sync: none, config time (a Python int)
        except OverflowError:  # 10**400
            raise UsageError(f"config field {field}: must be a finite number, "
                             f"got {value}") from None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise UsageError(f"config field {field}: expected {kind.__name__}, got {value!r}")
    return value


__all__ = ["REGISTRY", "Algorithm", "ClientTask", "RoundContext", "Upload", "build",
           "message_sizes", "params_table", "register", "resolved_params"]
