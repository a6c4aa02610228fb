"""Rank 0's writer of the results file (layout in ``fedmpi.results.schema``).

The file stays in SWMR mode for the whole run: readers can follow it live and every
flushed row survives a crash. SWMR only allows appending to datasets that already
exist, so all columns are created up front, and anything that adds or changes an
object or attribute (status, final model, checkpoints) goes through ``edit()``, which
leaves SWMR for the duration of the change.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from fedmpi import hdf5
from fedmpi.errors import UsageError
from fedmpi.results import checkpoint, liveness, schema
from fedmpi.results.attrs import _check_not_reserved, _root_attrs, _set_attrs
from fedmpi.results.columns import (check_fields, check_layout, column_values, create_columns,
                                     label, partition_arrays, write_layout, write_partition)


class ResultsWriter:
    """Appends rounds and client rows to one run's file; use ``ResultsWriter.create``."""

    def __init__(self, h5file: h5py.File, path: Path, n_params: int):
        self._file = h5file
        self.path = path
        self._n_params = n_params
        self._status = "running"
        self._inode = _inode(path)
        self._bind_columns()

    @classmethod
    def create(cls, path, *, config: dict, provenance: dict, round_fields: list[str],
               client_fields: list[str], layout: list[tuple[str, tuple[int, ...], int]],
               partition: dict[str, np.ndarray], force: bool = False,
               rank_fields: list[str] = (),
               tables: dict[str, list[str]] | None = None) -> "ResultsWriter":
        """Create the file with every dataset it will ever append to, then enter SWMR.

        All input is checked before the filesystem is touched, and the file is built
        under a temporary name in the same directory that replaces ``path`` in one
        rename only once it is complete: a bad call or a failure while creating never
        destroys an existing file, even with ``force``.
        """
        path = Path(path)
        attrs = _root_attrs(config, provenance)
        check_fields("round_fields", round_fields)
        check_fields("client_fields", client_fields)
        if rank_fields:
            check_fields("rank_fields", rank_fields)
        tables = dict(tables or {})
        for name, fields in tables.items():   # more tables of rows (/client_eval)
            if name not in schema.TABLES:
                raise ValueError(f"table {name!r} is not one of {list(schema.TABLES)}")
            check_fields(name, fields)
        layout = check_layout(layout)
        partition = partition_arrays(partition)
        _prepare_path(path, force)

        def fill(h5file: h5py.File) -> int:
            _set_attrs(h5file, attrs)
            write_partition(h5file.create_group("partition"), partition)
            create_columns(h5file.create_group("rounds"), round_fields, schema.ROUND_CHUNK)
            create_columns(h5file.create_group("clients"), client_fields, schema.CLIENT_CHUNK)
            create_columns(h5file.create_group("ranks"), list(rank_fields), schema.CLIENT_CHUNK)
            for name, fields in tables.items():
                create_columns(h5file.create_group(name), list(fields), schema.CLIENT_CHUNK)
            return write_layout(h5file.create_group("model"), layout)

        temporary = _temporary(path, "tmp")
        try:
            h5file = hdf5.File(temporary, "w", libver=schema.LIBVER)
        except OSError as exc:
            temporary.unlink(missing_ok=True)   # HDF5 may have made it before failing
            raise UsageError(f"results file {path}: cannot write in {path.parent} "
                             f"({_reason(exc)})") from None
        try:
            writer = cls._into_swmr(h5file, temporary, fill)
            os.replace(temporary, path)   # the open file follows the rename
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        writer.path = path
        return writer

    @classmethod
    def resume(cls, path, completed_rounds: int, **attrs) -> "ResultsWriter":
        """Reopen a run's file to continue after ``completed_rounds`` (its checkpoint):
        rows of later rounds, written before the run stopped, are cut so that the
        resumed rounds replace them; ``attrs`` (e.g. the resume history) are set."""
        path = Path(path)
        _check_not_reserved("resume attrs", attrs)

        def fill(h5file: h5py.File) -> int:
            checkpoint.truncate(h5file, completed_rounds)
            _set_attrs(h5file, {"status": "running", **attrs})
            return int(h5file["model/layout/sizes"][()].sum())

        return cls._into_swmr(reopen(path), path, fill)

    @classmethod
    def _into_swmr(cls, h5file: h5py.File, path: Path, fill) -> "ResultsWriter":
        """``fill(h5file)`` (returns the parameter count), then SWMR for the rest of the run;
        the file is closed if anything fails."""
        try:
            n_params = fill(h5file)
            h5file.flush()
            h5file.swmr_mode = True
        except BaseException:
            h5file.close()
            raise
        return cls(h5file, path, n_params)

    def write_checkpoint(self, completed_rounds: int, server: dict[str, np.ndarray], clients,
                         client_sizes: dict[str, int], num_clients: int) -> None:
        """Store the state to continue from after ``completed_rounds`` (see ``checkpoint``)."""
        with self.edit() as h5file:
            checkpoint.write(h5file, completed_rounds, server, clients, client_sizes, num_clients)

    def use_checkpoint(self, ckpt) -> None:
        """After a damaged slot was skipped: ``ckpt`` (or none) becomes the current one."""
        with self.edit() as h5file:
            checkpoint.point_at(h5file, ckpt)

    def checkpoint_growth(self, server_bytes: int, clients: int, state_bytes: int) -> int:
        """Bytes the next ``write_checkpoint`` would add to the file (``checkpoint.growth``)."""
        return checkpoint.growth(self._file, server_bytes, clients, state_bytes)

    def append_round(self, row: dict[str, float]) -> None:
        """One row per round; fields left out read back as NaN (or -1 for int fields).

        Appends are buffered by HDF5 until ``flush``: the runtime appends a round's rows
        (round, clients, ranks) and flushes once, so a crash loses at most that round."""
        self._append(self._rounds, "round_fields", {k: [v] for k, v in row.items()}, 1)

    def flush(self) -> None:
        """Make every appended row durable and visible to SWMR readers."""
        self._file.flush()

    def append_clients(self, rows: dict[str, np.ndarray]) -> None:
        """Many participations at once (one per element)."""
        self._append_rows(self._clients, "client_fields", rows)

    def append_ranks(self, rows: dict[str, np.ndarray]) -> None:
        """One row per (round, rank): bytes moved, busy and idle seconds of each rank."""
        self._append_rows(self._ranks, "rank_fields", rows)

    def append_table(self, name: str, rows: dict[str, np.ndarray]) -> None:
        """Rows of one of the extra tables the file was created with (``schema.TABLES``)."""
        self._append_rows(self._tables[name], name, rows)

    def _append_rows(self, columns, what: str, rows: dict[str, np.ndarray]) -> None:
        lengths = {np.shape(v) for v in rows.values()}
        if len(lengths) > 1 or any(len(n) != 1 for n in lengths):
            raise ValueError(f"{what} rows must be equal-length 1-D arrays, got shapes {sorted(lengths)}")
        n = lengths.pop()[0] if lengths else 0
        if n:
            self._append(columns, what, rows, n)

    def append_eval(self, row: dict[str, float], spectrum: np.ndarray | None = None,
                    local: dict | None = None) -> None:
        """One probe evaluation of a representation learner into /eval (see ``schema``):
        a row of scalars (``round`` first), optionally the feature spectrum, and the
        spectra of clients' local models ({client: values}, into /local_spectra). Rare
        and expensive, so written outside SWMR like the model; a column first seen now
        reads NaN for the earlier rows."""
        with self.edit() as h5file:
            append_eval(h5file, row, spectrum, local)
            h5file.flush()

    def write_model(self, params: np.ndarray, name: str = "final") -> None:
        """Store a flat parameter vector as float32 under /model/<name> (replacing it)."""
        vec = np.asarray(params, dtype=np.float32).reshape(-1)
        if self._n_params and vec.size != self._n_params:
            raise ValueError(f"model {name!r} has {vec.size} parameters, layout has {self._n_params}")
        if not name or "/" in name or name == "layout":
            raise ValueError(f"model name {name!r} must be non-empty, without '/', and not 'layout'")
        with self.edit() as h5file:
            group = h5file["model"]
            if name in group:
                del group[name]
            group.create_dataset(name, data=vec)

    def set_status(self, status: str, **attrs) -> None:
        """Record the run's state, plus context such as failed_round=7, error="..."."""
        if status not in schema.STATUSES:
            raise ValueError(f"status must be one of {', '.join(schema.STATUSES)}, got {status!r}")
        _check_not_reserved("set_status attrs", attrs)
        with self.edit() as h5file:
            _set_attrs(h5file, {"status": status, **attrs})
        self._status = status

    @property
    def status(self) -> str:
        return self._status

    @contextmanager
    def edit(self):
        """Yield the h5py.File outside SWMR, to create or change objects and attributes.

        Why reopen: a SWMR writer may only append to existing datasets.
        """
        self._file.close()
        self._check_still_ours()   # before opening: opening r+ writes the superblock's flags
        try:
            self._file = reopen(self.path)
            self._check_still_ours()   # replaced between the check and the open
        except FileNotFoundError:
            self._check_still_ours()
            raise
        except FileReplacedError:
            self._file.close()
            raise
        try:
            yield self._file
        finally:
            self._file.flush()
            if not self._file.swmr_mode:
                self._file.swmr_mode = True
            self._bind_columns()

    def _check_still_ours(self) -> None:
        """Raise if the path no longer names the file this writer created: removed (`rm`:
        what it held went with it) or replaced (a user's `mv` over it)."""
        try:
            inode = _inode(self.path)
        except FileNotFoundError:
            raise FileReplacedError(f"results file {self.path} was removed by another process "
                                    f"during this run; its rounds went with it") from None
        if inode != self._inode:
            raise FileReplacedError(f"results file {self.path} was replaced by another process "
                                    f"during this run; this run's results are not in it")

    def close(self) -> None:
        """Flush and close; safe to call twice."""
        if self._file.id.valid:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """An exception escaping a still-running run marks it, so the file says why it stopped."""
        try:
            if exc_type is not None and self._status == "running" and self._file.id.valid:
                status = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed"
                self.set_status(status, error=_one_line(exc_type, exc))
        except Exception:  # best effort: never hide the exception that ended the run
            pass
        finally:
            self.close()

    def _bind_columns(self) -> None:
        """Cache dataset handles; they go stale whenever ``edit`` reopens the file."""
        self._rounds = {name: ds for name, ds in self._file["rounds"].items()}
        self._clients = {name: ds for name, ds in self._file["clients"].items()}
        self._ranks = {name: ds for name, ds in self._file["ranks"].items()} \
            if "ranks" in self._file else {}
        self._tables = {table: dict(self._file[table].items()) for table in schema.TABLES
                        if table in self._file}

    def _append(self, columns: dict, what: str, values: dict, n: int) -> None:
        """Convert every column before growing any, so a bad value cannot leave them ragged."""
        unknown = sorted(set(values) - set(columns))
        if unknown:
            raise ValueError(f"{unknown} not in {what} {sorted(columns)}")
        data = {name: column_values(name, values.get(name), n) for name in columns}
        for name, ds in columns.items():
            start = ds.shape[0]
            ds.resize((start + n,))
            ds[start:] = data[name]


def append_eval(h5file: h5py.File, row: dict[str, float], spectrum: np.ndarray | None,
                local: dict | None = None, overrides: list[str] | None = None) -> None:
    """Append one /eval row (and spectrum row, and /local_spectra rows) to an open,
    writable results file; ``overrides``: a `fedmpi evaluate` row's eval.* settings, kept
    by row in the group's ``posthoc_overrides``."""
    if local:
        _append_local_spectra(h5file, int(row["round"]), local)
    group = h5file.require_group("eval")
    group.attrs["schema_version"] = schema.SCHEMA_VERSION
    fields = json.loads(group.attrs.get("fields", "[]"))
    n = group["round"].shape[0] if "round" in group else 0
    for name in row:
        if name not in fields:
            fields.append(name)
            dtype = schema.column_dtype(name)
            label(group.create_dataset(name, shape=(n,), maxshape=(None,), dtype=dtype,
                                        fillvalue=schema.fill_value(name), chunks=(64,)))
    group.attrs["fields"] = json.dumps(fields)
    if overrides is not None:
        posthoc = json.loads(group.attrs.get("posthoc_overrides", "{}"))
        group.attrs["posthoc_overrides"] = json.dumps({**posthoc, str(n): list(overrides)})
    for name in fields:
        ds = group[name]
        ds.resize((n + 1,))
        ds[n] = row.get(name, schema.fill_value(name))
    if spectrum is None and "spectrum" not in group:
        return
    values = None if spectrum is None else np.asarray(spectrum, dtype=np.float64).reshape(-1)
    if "spectrum" not in group:   # rows aligned with /eval rows; NaN where not measured
        group.create_dataset("spectrum", shape=(n, values.size), maxshape=(None, values.size),
                             dtype="f8", fillvalue=np.nan, chunks=(1, values.size))
    ds = group["spectrum"]
    ds.resize((n + 1, ds.shape[1]))
    ds[n] = np.nan if values is None else values


def _append_local_spectra(h5file: h5py.File, round_: int, local: dict) -> None:
    """/local_spectra: round, client, spectrum [rows, F]: one row per client model."""
    group = h5file.require_group("local_spectra")
    clients = sorted(local)
    values = np.stack([np.asarray(local[c], dtype=np.float64).reshape(-1) for c in clients])
    if "round" not in group:
        group.attrs["schema_version"] = schema.SCHEMA_VERSION
        group.attrs["fields"] = json.dumps(["round", "client"])
        for name in ("round", "client"):
            group.create_dataset(name, shape=(0,), maxshape=(None,), dtype="i8", chunks=(64,))
        group.create_dataset("spectrum", shape=(0, values.shape[1]), maxshape=(None, values.shape[1]),
                             dtype="f8", chunks=(1, values.shape[1]))
    n, k = group["round"].shape[0], len(clients)
    for name, data in (("round", np.full(k, round_)), ("client", np.asarray(clients)), ("spectrum", values)):
        ds = group[name]
        ds.resize((n + k,) + ds.shape[1:])
        ds[n:] = data


def _temporary(path: Path, kind: str) -> Path:
    """A hidden name beside ``path`` for a file being built: ``.run.h5.<host>.<pid>.tmp``.
    Leftovers of processes on this host that died building one are removed first."""
    for old in liveness.left_by_the_dead(path.parent, f".{path.name}.", f".{kind}"):
        old.unlink(missing_ok=True)
    return path.parent / f".{path.name}.{socket.gethostname()}.{os.getpid()}.{kind}"


class FileReplacedError(RuntimeError):
    """The results file at the writer's path is no longer the one it created."""


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _reason(exc: OSError) -> str:
    return exc.strerror or " ".join(str(exc).split())


def reopen(path: Path) -> h5py.File:
    """Reopen for writing without a lock: live SWMR readers hold a shared one.

    A reader in this same process shares HDF5's file object, whose locking flag must
    match, hence the fallback.
    """
    try:
        return h5py.File(path, "r+", libver=schema.LIBVER, locking=False)
    except OSError:
        return hdf5.File(path, "r+", libver=schema.LIBVER)


def _prepare_path(path: Path, force: bool) -> None:
    """Refuse to clobber a previous run unless asked (it is replaced by a rename at the
    end of ``create``, so live readers keep theirs), and anything else always."""
    if path.is_dir():
        raise UsageError(f"results file {path} is a directory; give a file path such as {path / 'run.h5'}")
    if (path.exists() or path.is_symlink()) and not force:
        raise UsageError(f"results file {path} exists; "
                         "pass --force to overwrite or choose another output")
    refuse_foreign(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"results file {path}: cannot create directory {path.parent} "
                         f"({_reason(exc)})") from exc


def refuse_foreign(path) -> None:
    """--force overwrites results files only: an existing file that is not one (the
    config itself, a dataset, notes: ``-o exp.toml --force``) or that is no file at all
    (``-o /dev/null``, which as root would be replaced by a file) is a UsageError. A
    results file cut short or left open by a dead writer (HDF5 that fails to open), and
    an empty file, may be overwritten."""
    path = Path(path)
    try:
        mode = path.stat().st_mode   # through links: /dev/stdout is a link to a pipe
    except OSError:
        return   # nothing there (or a dangling link): nothing to lose
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), None)
    if kind:   # `-o /dev/null --force` as root would replace the device with a file
        raise UsageError(f"results file {path} exists and is {kind}, not a file; fedmpi "
                         f"writes its results to a file of their own: choose one with -o/--output")
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        what = None if h5py.is_hdf5(path) else "not an HDF5 file"
        if what is None:
            with hdf5.File(path, "r") as h5file:
                if h5file.attrs.get("format") not in (schema.FORMAT, schema.FORMAT.encode()):
                    what = "an HDF5 file but not a fedmpi results file"
    except OSError:
        return   # damaged, or open for writing: a run's file as far as can be told
    if what:
        raise UsageError(f"results file {path} exists and is {what}; --force overwrites "
                         f"fedmpi results files only: choose another output with -o/--output")


def _one_line(exc_type, exc) -> str:
    text = " ".join(str(exc).split())
    return f"{exc_type.__name__}: {text}" if text else exc_type.__name__
