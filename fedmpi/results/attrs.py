"""The results file's root attributes: identity, the resolved config and its hash,
provenance; values HDF5 cannot hold natively are stored as JSON strings and named in the
``json_attrs`` attribute, so readers parse exactly those."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from fedmpi import __version__
from fedmpi.results import schema


def _root_attrs(config: dict, provenance: dict) -> dict:
    """Root attributes: identity, the resolved config, its hash, and provenance."""
    _check_not_reserved("provenance", provenance)
    config_json = json.dumps(config, sort_keys=True, default=_json_default)
    return {
        "format": schema.FORMAT,
        "schema_version": schema.SCHEMA_VERSION,
        "fedmpi_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": "running",
        "config": _JSON(config_json),
        "config_hash": hashlib.sha256(config_json.encode()).hexdigest()[:16],
        **{key: _encode(value) for key, value in provenance.items()},
    }


class _JSON(str):
    """A string that already is JSON: stored verbatim and listed in ``json_attrs``."""


def _encode(value):
    """Scalars stay native HDF5 attributes; lists, dicts, None become JSON strings."""
    if isinstance(value, _JSON):
        return value
    if isinstance(value, str):
        return str(value)  # np.str_ has no HDF5 conversion; plain str is variable-length UTF-8
    if isinstance(value, (bool, int, float, np.integer, np.floating, np.bool_)):
        return value
    return _JSON(json.dumps(value, default=_json_default))


def _set_attrs(h5file: h5py.File, attrs: dict) -> None:
    """Write attrs, keeping ``json_attrs`` (which of them a reader must parse) up to date."""
    json_keys = set(json.loads(h5file.attrs.get("json_attrs", "[]")))
    for key, value in attrs.items():
        value = _encode(value)
        if isinstance(value, _JSON):
            json_keys.add(key)
            value = str(value)
        else:
            json_keys.discard(key)
        h5file.attrs[key] = value
    h5file.attrs["json_attrs"] = json.dumps(sorted(json_keys))


def _json_default(value):
    """Numpy scalars/arrays and paths appear in configs; turn them into JSON types."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _check_not_reserved(what: str, attrs: dict) -> None:
    clash = sorted(schema.RESERVED_ATTRS & set(attrs))
    if clash:
        raise ValueError(f"{what} may not set the writer's own root attributes {clash}")
