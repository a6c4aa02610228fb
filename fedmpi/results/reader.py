"""Read a fedmpi results file: finished, still being written (SWMR), or left by a crash.

A damaged file is one line, never a traceback or a hang: a file cut short is refused
before HDF5 sees it (a SWMR reader would retry its reads for minutes), a file left
open by a writer that died is read through ``repair.ReadView``, and an HDF5 read error
becomes a ``UsageError`` naming the file.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import h5py
import numpy as np

from fedmpi import __version__, hdf5
from fedmpi.config.schema import upgrade
from fedmpi.errors import UsageError
from fedmpi.results import checkpoint, liveness, repair, schema

_GROUPS = ("partition", "rounds", "clients", "model")
_RECHECK = 0.2          # seconds before a short file is called damaged: a writer may be extending it


def _reads(method):
    """HDF5 read errors (a corrupt or cut file) as a one-line UsageError naming the file;
    anything else (a bug) passes through."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (OSError, KeyError) as exc:
            raise UsageError(f"results file {self.path} cannot be read ({_reason(exc)})") from exc
    return wrapper


class RunFile:
    """One run's results, read-only; arrays are returned as numpy, fresh on every call."""

    def __init__(self, path):
        self.path = Path(path)
        self._file, self._view = _open(self.path)
        try:
            self._check()
        except BaseException:
            self.close()
            raise

    @property
    @_reads
    def attrs(self) -> dict:
        """Root attributes as Python values, JSON-encoded ones (config, hostnames) parsed."""
        raw = self._file.attrs
        json_keys = set(json.loads(raw.get("json_attrs", "[]")))
        out = {k: json.loads(raw[k]) if k in json_keys else _python(raw[k])
               for k in raw if k != "json_attrs"}
        if isinstance(out.get("config"), dict):   # renamed fields as ``config`` says them
            out["config"] = upgrade(out["config"])
        return out

    @property
    @_reads
    def config(self) -> dict:
        """The resolved experiment config the run used, fields renamed since under their
        current names (``config.schema.RENAMED``), so files of every version compare."""
        return upgrade(json.loads(self._file.attrs["config"]))

    @property
    @_reads
    def start_dir(self) -> Path | None:
        """The working directory the run started in, where its config's relative paths
        (``data.path``, ``system.state_dir``, ...) point from; None when it is not
        recorded (files written before it) or no longer a directory here."""
        where = self._file.attrs.get("cwd")
        if where is None:
            return None
        where = Path(_python(where))
        return where if where.is_dir() else None

    @property
    @_reads
    def status(self) -> str:
        """running|completed|failed|interrupted|pruned as of opening (reopen to see a change).

        "running" on a file no process writes any more means the run died.
        """
        return _python(self._file.attrs["status"])

    def rounds(self) -> dict[str, np.ndarray]:
        """Round columns in the writer's order, e.g. ``pd.DataFrame(run.rounds())``."""
        return self._columns("rounds")

    @_reads
    def ranks(self) -> dict[str, np.ndarray]:
        """One row per (round, rank): bytes sent/received, busy/idle/comm seconds."""
        return self._columns("ranks") if "ranks" in self._file else {}

    def clients(self) -> dict[str, np.ndarray]:
        """One row per (round, client) participation."""
        return self._columns("clients")

    @_reads
    def evals(self) -> dict[str, np.ndarray]:
        """/eval: one row per probe evaluation of a representation learner (round,
        linear_acc, finetune_<p>pct_acc, effective_rank, seconds); empty without probes."""
        return self._columns("eval") if "eval" in self._file else {}

    @_reads
    def eval_overrides(self) -> dict[int, list[str]]:
        """{/eval row: the eval.* settings `fedmpi evaluate` changed for it} for the rows it
        wrote (posthoc = 1); {} for a file without any."""
        if "eval" not in self._file:
            return {}
        text = self._file["eval"].attrs.get("posthoc_overrides", "{}")
        try:
            rows = json.loads(text).items()
            if not all(isinstance(values, list) for _, values in rows):
                raise TypeError("settings that are not a list")
            return {int(row): [str(v) for v in values] for row, values in rows}
        except (ValueError, TypeError, AttributeError) as exc:   # not JSON, or not {row: [...]}
            raise UsageError(f"results file {self.path} cannot be read (/eval's posthoc_overrides "
                             f"is not a JSON object of row: settings)") from exc

    @_reads
    def spectrum(self) -> np.ndarray:
        """/eval/spectrum [evaluations, F]: singular values of the global encoder's feature
        covariance, descending (NaN rows: not measured); shape (0, 0) without any."""
        if "eval" not in self._file or "spectrum" not in self._file["eval"]:
            return np.zeros((0, 0))
        ds = self._file["eval/spectrum"]
        if self._file.swmr_mode:
            ds.refresh()
        return ds[:len(self.evals().get("round", []))]

    @_reads
    def local_spectra(self) -> dict[str, np.ndarray]:
        """/local_spectra (eval.local_spectra): round, client, spectrum [rows, F]: the
        feature spectrum of each client's local model on probe rounds; {} without."""
        if "local_spectra" not in self._file:
            return {}
        group = self._file["local_spectra"]
        out = {}
        for name in ("round", "client", "spectrum"):
            if self._file.swmr_mode:
                group[name].refresh()
            out[name] = group[name][()]
        return out

    @_reads
    def partition(self) -> dict[str, np.ndarray]:
        """client_offsets, client_indices, class_counts, client_sizes (and any extras)."""
        return {name: ds[()] for name, ds in self._file["partition"].items()}

    @_reads
    def layout(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, offset) per tensor of the flat parameter vector."""
        table = self._file["model/layout"]
        names = table["names"].asstr()[()]
        shapes = table["shapes"].asstr()[()]
        offsets = table["offsets"][()]
        return [(str(n), tuple(json.loads(s)), int(o)) for n, s, o in zip(names, shapes, offsets)]

    @_reads
    def model_names(self) -> list[str]:
        """Stored parameter vectors, e.g. ["final"]."""
        return sorted(k for k in self._file["model"] if k != "layout")

    def model(self, name: str = "final") -> np.ndarray:
        """A stored flat float32 parameter vector."""
        if name not in self.model_names():
            available = ", ".join(self.model_names()) or "none yet"
            raise UsageError(f"results file {self.path} has no model {name!r} (available: {available})")
        return self._read_model(name)

    def state_dict(self, name: str = "final") -> dict[str, np.ndarray]:
        """The vector cut and reshaped by the layout, ready for torch.from_numpy/load_state_dict."""
        vec = self.model(name)
        return {n: vec[off:off + int(np.prod(shape, dtype=np.int64))].reshape(shape)
                for n, shape, off in self.layout()}

    @_reads
    def checkpoint(self):
        """The current checkpoint (``fedmpi.results.checkpoint.Checkpoint``) or None; valid
        while this file is open."""
        return checkpoint.read(self._file)

    def close(self) -> None:
        self._file.close()
        if self._view is not None:
            self._view.close()

    def __enter__(self) -> "RunFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunFile({str(self.path)!r}, status={self.status!r})"

    @_reads
    def _check(self) -> None:
        _check_format(self._file, self.path)

    @_reads
    def _read_model(self, name: str) -> np.ndarray:
        return self._file["model"][name][()]

    @_reads
    def client_eval(self) -> dict[str, np.ndarray]:
        """/client_eval (eval.clients): one row per (evaluation round, evaluated client);
        empty columns where the run did not score its clients."""
        return self._columns("client_eval") if "client_eval" in self._file else {}

    @_reads
    def _columns(self, group_name: str) -> dict[str, np.ndarray]:
        """Refresh (SWMR) and cut all columns to the rows every column has.

        A crash can land between two columns' appends; the shortest column marks the
        last complete row.
        """
        group = self._file[group_name]
        names = json.loads(group.attrs["fields"]) if "fields" in group.attrs else sorted(group)
        columns = [group[name] for name in names]
        if self._file.swmr_mode:
            for ds in columns:
                ds.refresh()
        n = min((ds.shape[0] for ds in columns), default=0)
        return {name: ds[:n] for name, ds in zip(names, columns)}


def open_run(path) -> RunFile:
    """Open a results file for reading (see ``RunFile``)."""
    return RunFile(path)


def _open(path: Path) -> tuple[h5py.File, repair.ReadView | None]:
    """The open file, and the ``ReadView`` it reads through if a writer died holding it.

    SWMR only where the superblock says a SWMR writer has the file open, and it is not
    known to be dead: SWMR is the only way to read a file being written, but it retries
    a failing read for minutes. A finished file is opened plainly, a file whose writer
    died through ``ReadView``, so a corrupt one fails at once.
    """
    if not path.is_file():
        raise UsageError(not_a_file(path))
    if not h5py.is_hdf5(path):
        raise UsageError(f"results file {path} is not an HDF5 file")
    try:
        why = repair.damage(path)
        if why is not None:
            time.sleep(_RECHECK)
            why = repair.damage(path)
        sb = repair.inspect(path)
    except OSError as exc:   # gone or unreadable since is_file
        raise UsageError(f"results file {path} cannot be opened ({_reason(exc)})") from exc
    if why is not None:
        raise UsageError(f"results file {path} is damaged ({why}); "
                         f"fedmpi run --resume {path} says what can be recovered")
    if sb is not None and sb.swmr_writing and not _writer_gone(path):
        try:
            return hdf5.File(path, "r", swmr=True), None
        except OSError:
            pass
    try:
        return hdf5.File(path, "r"), None
    except OSError as exc:
        if "unable to lock file" in str(exc):   # HDF5's lock: a writer outside SWMR has it
            raise UsageError(liveness.held_message(path)) from exc
        if "already open for write" not in str(exc):
            raise UsageError(f"results file {path} cannot be opened ({_reason(exc)})") from exc
    # the flags a writer sets while it has the file open, left behind because it died:
    # HDF5 refuses the file (outside SWMR) until they are cleared
    view = None
    try:
        view = repair.ReadView(path)
        return h5py.File(view, "r"), view
    except OSError as exc:
        if view is not None:
            view.close()
        raise UsageError(f"results file {path} cannot be opened ({_reason(exc)})") from exc


def not_a_file(path) -> str:
    """Why ``path``, not a regular file, cannot be a results file: the line to say."""
    path = Path(path)
    if path.is_dir():
        return f"results file {path} is a directory; give one run's results file (.h5)"
    if path.exists():
        return f"results file {path} is not a regular file (a device, a pipe or a socket)"
    return f"results file {path} does not exist"


def _writer_gone(path: Path) -> bool:
    """Whether the file's recorded writer is dead (``liveness``; only known on its host)."""
    return liveness.state(repair.recorded_writer(path)) == liveness.GONE


def _check_format(h5file: h5py.File, path: Path) -> None:
    """Name exactly what is missing, so a wrong file is told apart from a newer schema."""
    if _python(h5file.attrs.get("format")) != schema.FORMAT:
        raise UsageError(f"{path} is not a fedmpi results file "
                         f"(root attribute 'format' should be {schema.FORMAT!r})")
    version = int(h5file.attrs.get("schema_version", 0))
    if not 1 <= version <= schema.SCHEMA_VERSION:
        raise UsageError(f"results file {path} has schema_version {version}; fedmpi {__version__} "
                         f"reads 1..{schema.SCHEMA_VERSION}")
    missing = [g for g in _GROUPS if g not in h5file]
    if missing:
        raise UsageError(f"results file {path} lacks group(s) {', '.join('/' + g for g in missing)}")


def _reason(exc: BaseException) -> str:
    """An HDF5 error on one line (a KeyError's message without its quotes)."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    return " ".join(str(text).split())


def _python(value):
    """numpy scalars and bytes from h5py as plain Python values."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value
