"""Datasets kept as .npy files and mapped into memory: the benchmark files (LEAF's JSON,
TFF's HDF5) are parsed once, and afterwards every rank maps the arrays instead of
holding them.

``keep(path, build)`` returns the Dataset cached at ``path`` (a folder named by the
source files' digest and the loader's options), or builds it, writes it there (each
array one .npy file, the rest ``meta.json``; written into a temporary folder and renamed
into place, so a reader never sees half of it and two writers do not mix) and returns
it mapped. Mapped arrays are ``np.load(mmap_mode="c")``: the operating system reads a
sample's pages when training or evaluation first touches them and keeps them in its page
cache, which every rank of a node shares, so a rank holds only what its clients read,
and a dataset larger than memory trains (on CPU workers; a GPU worker copies the
training set to its device). A Dataset so made says where its arrays are
(``Dataset.mapped_from``), and ``Comm.node_shared`` lets each rank map them itself.
A cache that cannot be written (no writable folder, a full disk) is skipped: the
Dataset is returned in memory, as built. A build killed outright leaves its temporary
folder (named for its host and pid); the next build on that host removes those of
processes that are gone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..results import liveness
from .sources import Dataset

VERSION = 1
TENSORS = ("train_x", "train_y", "test_x", "test_y", "groups", "test_groups", "held_out")
META = ("name", "num_classes", "mean", "std", "source", "modality", "group_names", "vocab_size")


def root(folder: Path) -> Path | None:
    """Where caches of files in ``folder`` go: ``folder/.fedmpi-cache`` where it can be
    written, else ``~/.cache/fedmpi``; None where neither can."""
    for where in (folder / ".fedmpi-cache", Path("~/.cache/fedmpi").expanduser()):
        if (where.is_dir() and os.access(where, os.W_OK)) or \
                (not where.exists() and os.access(_existing(where), os.W_OK)):
            return where
    return None


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def keep(path: Path | None, build: Callable[[Path | None], object]):
    """The Dataset cached at ``path``, else ``build(folder)``'s, cached there and mapped.
    ``folder`` is where ``build`` may write arrays itself, as .npy files named for the
    Dataset's fields (a loader that streams its files into the cache, holding one client
    at a time: fedmpi.data.natural), or None (no cache: build in memory); the Dataset's
    other arrays are saved from it."""
    if path is not None and path.exists():
        found = _mapped(path)
        if found is not None:
            return found
        shutil.rmtree(path, ignore_errors=True)   # damaged, or of another version: anew
    partial = None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for stale in liveness.left_by_the_dead(path.parent, f".{path.name}.", "-*"):
                shutil.rmtree(stale, ignore_errors=True)   # a build killed outright
            prefix = f".{path.name}.{socket.gethostname()}.{os.getpid()}-"
            partial = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
        except OSError:
            partial = None
    try:
        dataset = build(partial)
        if partial is None:
            return dataset
        _store(partial, path, dataset)   # or another writer's, the same arrays, came first
        return _mapped(path) or dataset
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)


def _store(partial: Path, path: Path, dataset) -> None:
    """The arrays ``build`` did not write, and meta.json, into ``partial``; then renamed
    to ``path`` in one step."""
    try:
        for name in TENSORS:
            tensor = getattr(dataset, name)
            if tensor is not None and not (partial / f"{name}.npy").is_file():
                np.save(partial / f"{name}.npy", tensor.detach().cpu().numpy())
        meta = {key: getattr(dataset, key) for key in META}
        meta["mean"], meta["std"] = list(meta["mean"]), list(meta["std"])
        (partial / "meta.json").write_text(json.dumps({"version": VERSION, **meta}))
        os.replace(partial, path)   # fails where another writer's is there: theirs stays
    except OSError:
        pass   # no cache this time (a full disk), or another writer's: keep maps what is there


def _mapped(path: Path):
    """The Dataset whose arrays are the .npy files at ``path``, mapped; None where the
    folder is not a complete cache of this version."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.pop("version", None) != VERSION:
            return None
        tensors = {name: torch.from_numpy(np.load(path / f"{name}.npy", mmap_mode="c"))
                   if (path / f"{name}.npy").is_file() else None for name in TENSORS}
    except (OSError, ValueError):
        return None
    meta["mean"], meta["std"] = tuple(meta["mean"]), tuple(meta["std"])
    return Dataset(**{**meta, **tensors}, mapped_from=str(path))
