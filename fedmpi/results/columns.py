"""The results file's fixed parts, made by the writer at creation: the column groups
(extendable, created before SWMR starts), the model layout table, the partition arrays,
and each appended column's values in its dtype (``fedmpi.results.schema``)."""

from __future__ import annotations

import json

import h5py
import numpy as np

from fedmpi.results import schema


def check_fields(what: str, fields: list[str]) -> None:
    """Field names become dataset names, so they must be unique plain names."""
    bad = [f for f in fields if not isinstance(f, str) or not f or "/" in f or f.startswith(".")]
    if bad or len(set(fields)) != len(fields):
        raise ValueError(f"{what} must be unique non-empty names without '/', got {list(fields)}")


def check_layout(layout) -> list[tuple[str, tuple[int, ...], int]]:
    """Normalize (name, shape, offset) triples; shapes may come as torch.Size or lists."""
    out = [(str(name), tuple(int(d) for d in shape), int(offset)) for name, shape, offset in layout]
    if len({name for name, _, _ in out}) != len(out):
        raise ValueError("layout names must be unique")
    return out


def partition_arrays(partition: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Integer arrays as int64 (floats kept float64, for per-client skew parameters)."""
    arrays = {str(k): np.asarray(v) for k, v in partition.items()}
    if "client_sizes" not in arrays and "client_offsets" in arrays:
        arrays["client_sizes"] = np.diff(arrays["client_offsets"])
    return {k: a.astype(np.float64 if a.dtype.kind == "f" else np.int64) for k, a in arrays.items()}


def write_partition(group: h5py.Group, arrays: dict[str, np.ndarray]) -> None:
    group.attrs["schema_version"] = schema.SCHEMA_VERSION
    for name, arr in arrays.items():
        big = arr.size >= schema.COMPRESS_MIN_SIZE
        group.create_dataset(name, data=arr, compression="gzip" if big else None)


def create_columns(group: h5py.Group, fields: list[str], chunk: int) -> None:
    """Empty extendable columns; they must exist before SWMR starts."""
    group.attrs["schema_version"] = schema.SCHEMA_VERSION
    group.attrs["fields"] = json.dumps(list(fields))
    for field in fields:
        label(group.create_dataset(field, shape=(0,), maxshape=(None,), chunks=(chunk,),
                                    dtype=schema.column_dtype(field), fillvalue=schema.fill_value(field)))


def label(ds: h5py.Dataset) -> None:
    """The column's ``units`` attribute, where its name has one (``schema.units_of``)."""
    unit = schema.units_of(ds.name.rsplit("/", 1)[-1])
    if unit:
        ds.attrs["units"] = unit


def write_layout(group: h5py.Group, layout: list[tuple[str, tuple[int, ...], int]]) -> int:
    """One row per tensor in four plain columns, so pandas/h5py users need no decoding tricks."""
    group.attrs["schema_version"] = schema.SCHEMA_VERSION
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in layout]
    n_params = max((off + size for (_, _, off), size in zip(layout, sizes)), default=0)
    group.attrs["n_params"] = n_params
    table = group.create_group("layout")
    table.attrs["schema_version"] = schema.SCHEMA_VERSION
    strings = h5py.string_dtype("utf-8")
    table.create_dataset("names", data=[name for name, _, _ in layout], dtype=strings, shape=(len(layout),))
    table.create_dataset("shapes", data=[json.dumps(list(s)) for _, s, _ in layout], dtype=strings,
                         shape=(len(layout),))
    table.create_dataset("offsets", data=np.array([o for _, _, o in layout], dtype=np.int64))
    table.create_dataset("sizes", data=np.array(sizes, dtype=np.int64))
    return n_params


def column_values(field: str, values, n: int) -> np.ndarray:
    """Values for one column, in its dtype; int columns take NaN as -1 and refuse fractions."""
    if values is None:
        return np.full(n, schema.fill_value(field), dtype=schema.column_dtype(field))
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise ValueError(f"{field}: expected {n} values, got shape {arr.shape}")
    if schema.column_dtype(field) == "float64" or arr.dtype.kind in "iub":
        return arr.astype(schema.column_dtype(field))
    arr = np.where(np.isnan(arr.astype(np.float64)), schema.INT_FILL, arr.astype(np.float64))
    if not np.array_equal(arr, np.round(arr)):
        raise ValueError(f"{field} holds integers, got {arr.tolist()}")
    return arr.astype(np.int64)
