"""A Dataset of natural clients built one client at a time (LEAF's shards, TFF's files:
342,477 StackOverflow users do not fit a node's memory as windows): each client's samples
go straight into .npy files in the cache folder being written (fedmpi.data.cache), or
into memory where there is no cache. The Dataset: the train file's samples in client
order, then the test samples of clients that also train (``held_out``: each one's local
test split under the natural partition, never trained on), and every test sample in the
global test set (``test_groups``: its client, -1 for one that does not train).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .sources import Dataset, histogram_stats

HEADER = 256   # bytes of a .npy header left for the final shape (numpy reads its length)


class Rows:
    """A growing array of rows of ``dtype`` and ``shape``: appended to a raw .npy file
    whose header is written last (``folder``), or to a list of chunks (None)."""

    def __init__(self, folder: Path | None, name: str, dtype, shape: tuple = ()):
        self.dtype, self.shape, self.count = np.dtype(dtype), tuple(shape), 0
        self.path = None if folder is None else folder / f"{name}.npy"
        self.chunks: list[np.ndarray] = []
        self.file = None
        if self.path is not None:
            self.file = open(self.path, "wb")
            self.file.write(b"\0" * HEADER)

    def add(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.shape:
            raise ValueError(f"rows of shape {rows.shape[1:]}, expected {self.shape}")
        if self.file is not None:
            self.file.write(memoryview(rows).cast("B"))
        else:
            self.chunks.append(rows)
        self.count += len(rows)

    def extend(self, other: "Rows") -> None:
        """``other``'s rows after these (its file copied a block at a time)."""
        if other.file is None:
            for chunk in other.chunks:
                self.add(chunk)
            return
        other.file.flush()
        with open(other.path, "rb") as f:
            f.seek(HEADER)
            for block in iter(lambda: f.read(1 << 24), b""):
                self.file.write(block)
        self.count += other.count

    def finish(self) -> np.ndarray:
        """The array: the file's header written and the file mapped, or the chunks joined."""
        if self.file is None:
            return np.concatenate(self.chunks) if self.chunks else \
                np.zeros((0, *self.shape), self.dtype)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.count, *self.shape)}
        text = repr(header).encode("latin1")
        prefix = np.lib.format.MAGIC_PREFIX + bytes([1, 0])
        length = HEADER - len(prefix) - 2
        self.file.seek(0)
        self.file.write(prefix + length.to_bytes(2, "little") + text.ljust(length - 1) + b"\n")
        self.file.close()
        self.file = None
        return np.load(self.path, mmap_mode="c")

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class Builder:
    """``train(client, x, y)`` for the train file's clients in order (``client`` its
    index), ``test(client, x, y)`` for the test file's (-1: a client that does not
    train), then ``finish(...)`` -> the Dataset. Images' channel statistics come from a
    256-bin histogram accumulated client by client (exact, as ``channel_stats``)."""

    def __init__(self, folder: Path | None, x_dtype, x_shape: tuple, image: bool):
        self.folder, self.image = folder, image
        rows = {"train": (x_dtype, x_shape), "held": (x_dtype, x_shape),
                "test": (x_dtype, x_shape)}
        self.x = {k: Rows(folder, f"{k}_x" if k != "held" else ".held_x", *v)
                  for k, v in rows.items()}
        self.y = {k: Rows(folder, f"{k}_y" if k != "held" else ".held_y", np.int64)
                  for k in rows}
        self.owners = {k: Rows(None, k, np.int64) for k in rows}
        self.hist = np.zeros((x_shape[0], 256), np.int64) if image else None

    def train(self, client: int, x: np.ndarray, y: np.ndarray) -> None:
        self._add("train", client, x, y)
        if self.hist is not None:
            for c in range(x.shape[1]):
                self.hist[c] += np.bincount(x[:, c].reshape(-1), minlength=256)

    def test(self, client: int, x: np.ndarray, y: np.ndarray) -> None:
        self._add("test", client, x, y)
        if client >= 0:
            self._add("held", client, x, y)

    def _add(self, part: str, client: int, x, y) -> None:
        self.x[part].add(x)
        self.y[part].add(y)
        self.owners[part].add(np.full(len(y), client, np.int64))

    def close(self) -> None:
        """Drop what was written (a build that failed: the cache folder goes too)."""
        for rows in (*self.x.values(), *self.y.values()):
            rows.discard()

    def finish(self, name: str, num_classes: int, source: str, names: list[str],
               vocab_size: int | None = None) -> Dataset:
        n_train, n_held = self.x["train"].count, self.x["held"].count
        for rows in (self.x, self.y):
            rows["train"].extend(rows["held"])
            rows["held"].discard()
        owners = {k: torch.from_numpy(v.finish()) for k, v in self.owners.items()}
        held = np.concatenate([np.zeros(n_train, bool), np.ones(n_held, bool)])
        mean, std = ((0.0,), (1.0,)) if self.hist is None else \
            histogram_stats(torch.from_numpy(self.hist))   # channel_stats', on the same counts
        tensor = {f"{k}_{a}": torch.from_numpy(rows[k].finish())
                  for a, rows in (("x", self.x), ("y", self.y)) for k in ("train", "test")}
        return Dataset(name, tensor["train_x"], tensor["train_y"], tensor["test_x"],
                       tensor["test_y"], num_classes, mean, std, source,
                       modality="image" if self.image else "text",
                       groups=torch.cat([owners["train"], owners["held"]]),
                       group_names=list(names), test_groups=owners["test"],
                       held_out=torch.from_numpy(held), vocab_size=vocab_size)
