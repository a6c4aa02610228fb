"""Finding results files and reading each into a ``Run``: plain dicts and numpy arrays.

A ``Run`` reads its attributes, config and round rows when it is made and closes the
file, so hundreds of runs can be held at once and a notebook never keeps a file open
that a running experiment is writing. Client, rank and partition rows are read on first
use (they can be large), by reopening the file.

Rows superseded by a resume are dropped here, once, so every table and metric sees one
row per round: if a round number appears again further down (a resumed run re-ran it
from its last checkpoint), the later rows win.
"""

from __future__ import annotations

import glob
import math
import warnings
from functools import cached_property
from pathlib import Path

import numpy as np

from fedmpi.config.since import as_started
from fedmpi.errors import UsageError
from fedmpi.results import liveness, open_run


class Run:
    """One run's results file, read: ``path, attrs, config, status, rounds`` (eager),
    ``clients, ranks, partition`` (on first use). ``get("train.lr")`` reads the config."""

    def __init__(self, path):
        self.path = Path(path)
        with open_run(self.path) as f:
            self.attrs: dict = f.attrs
            self.config: dict = f.config
            # a parameter added since the file was written reads as what its rounds ran
            # (FedCM's decay: "code"), so tables tell old runs from new ones
            as_started(self.config)
            self.rounds: dict[str, np.ndarray] = latest_rows(f.rounds(), by_block=False)

    @cached_property
    def status(self) -> str:
        """running|completed|failed|interrupted|pruned as the file says, or crashed: the file
        says running but its writer is gone (seen from the writer's host), as of first
        use (load again to refresh)."""
        return liveness.seen_status(str(self.attrs.get("status", "unknown")), self.attrs.get("writer"))

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    def get(self, key: str, default=None):
        """A config value by dotted key, e.g. ``run.get("partition.alpha")``."""
        return get_key(self.config, key, default)

    @cached_property
    def final_norm(self) -> float:
        """||x||_2 of the final global model (/model/final, summed in float64); NaN for a
        run that has none (still going, or stopped before its end)."""
        with open_run(self.path) as f:
            try:
                final = f.model("final")
            except (KeyError, UsageError):   # no /model group, or no final vector in it
                return math.nan
        return float(np.linalg.norm(final.astype(np.float64)))

    @cached_property
    def clients(self) -> dict[str, np.ndarray]:
        """One row per (round, client) participation, e.g. ``pd.DataFrame(run.clients)``."""
        with open_run(self.path) as f:
            return latest_rows(f.clients(), by_block=True)

    @cached_property
    def ranks(self) -> dict[str, np.ndarray]:
        """One row per (round, MPI rank); empty for files written before /ranks existed."""
        with open_run(self.path) as f:
            return latest_rows(f.ranks(), by_block=True)

    @cached_property
    def evals(self) -> dict[str, np.ndarray]:
        """/eval: one row per probe evaluation of a self-supervised encoder (linear_acc,
        finetune_<p>pct_acc, effective_rank, ...); empty without probes."""
        with open_run(self.path) as f:
            return f.evals()

    @cached_property
    def eval_overrides(self) -> dict[int, list[str]]:
        """{/eval row: the eval.* settings `fedmpi evaluate` changed for it}."""
        with open_run(self.path) as f:
            return f.eval_overrides()

    @cached_property
    def spectrum(self) -> np.ndarray:
        """/eval/spectrum: [evaluations, F] singular values, rows aligned with ``evals``."""
        with open_run(self.path) as f:
            return f.spectrum()

    @cached_property
    def partition(self) -> dict[str, np.ndarray]:
        """client_offsets, client_indices, class_counts, client_sizes and any extras."""
        with open_run(self.path) as f:
            return f.partition()

    @property
    def n_rounds(self) -> int:
        """Trained rounds recorded (after dropping rows a resume re-ran); the initial
        model's row (round 0) is not one."""
        return int(np.count_nonzero(np.asarray(self.rounds.get("round", ())) >= 1))

    def __repr__(self) -> str:
        return (f"Run({str(self.path)!r}, algorithm={self.get('algorithm.name')!r}, "
                f"seed={self.get('seed')!r}, status={self.status!r}, rounds={self.n_rounds})")


def get_key(config: dict, key: str, default=None):
    """config["a"]["b"] for "a.b"; ``default`` when any level is absent."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def latest_rows(columns: dict[str, np.ndarray], by_block: bool) -> dict[str, np.ndarray]:
    """Drop rows that a later rerun of the same round supersedes.

    Round rows: one per round, so the last row of each round number wins. Client and
    rank rows come as blocks of rows with the same round: the last block of each round
    number wins.
    """
    rounds = columns.get("round")
    if rounds is None or len(rounds) < 2 or np.all(np.diff(rounds) > (0 if not by_block else -1)):
        return columns
    keep = _last_block_mask(rounds) if by_block else _last_row_mask(rounds)
    return {name: column[keep] for name, column in columns.items()}


def _last_row_mask(rounds: np.ndarray) -> np.ndarray:
    """Keep row i iff every later row has a larger round number (later rows win)."""
    later_min = np.minimum.accumulate(rounds[::-1])[::-1]
    later_min = np.append(later_min[1:], np.iinfo(np.int64).max)
    return rounds < later_min


def _last_block_mask(rounds: np.ndarray) -> np.ndarray:
    """Keep a block of equal round numbers iff every later block has a larger round."""
    starts = np.flatnonzero(np.r_[True, rounds[1:] != rounds[:-1]])
    block_rounds = rounds[starts]
    keep_block = _last_row_mask(block_rounds)
    lengths = np.diff(np.r_[starts, len(rounds)])
    return np.repeat(keep_block, lengths)


def load(*sources, strict: bool = False) -> list[Run]:
    """Runs from files, directories (searched recursively for *.h5) and glob patterns.

    A file named explicitly must be a fedmpi results file (else ``UsageError``). Files
    found by a directory search or a glob that are not (other HDF5 data, a newer schema)
    are skipped with a warning, or raise ``UsageError`` when ``strict``. Runs come back
    in path order; each path once.
    """
    paths = _expand(sources)
    runs, seen = [], set()
    for path, named in paths:
        key = path.resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            runs.append(Run(path))
        except UsageError as exc:
            if named or strict:
                raise
            warnings.warn(f"skipping {path}: {exc}", SkippedFileWarning, stacklevel=2)
    if not runs:
        raise UsageError(f"no fedmpi results files in {', '.join(map(str, _flat(sources)))}")
    return runs


class SkippedFileWarning(UserWarning):
    """A file found by a directory search or glob was not a readable fedmpi results file."""


def _flat(sources) -> list:
    out = []
    for source in sources:
        if isinstance(source, (list, tuple)):
            out.extend(_flat(source))
        else:
            out.append(source)
    return out


def _expand(sources) -> list[tuple[Path, bool]]:
    """(path, named explicitly) in the order given; a directory's and a glob's files sorted."""
    items = _flat(sources)
    if not items:
        raise UsageError("no results files given: name files, directories or glob patterns")
    out = []
    for source in items:
        path = Path(source)
        if path.is_dir():
            out += [(p, False) for p in sorted(path.rglob("*.h5")) if p.is_file()]
        elif path.exists():
            out.append((path, True))
        elif glob.has_magic(str(source)):
            out += [(Path(p), False) for p in sorted(glob.glob(str(source), recursive=True))
                    if Path(p).is_file()]
        else:
            raise UsageError(f"results file {path} does not exist")
    return out
