"""Tiny-ImageNet from its standard folder layout, decoded once and cached as arrays.

Layout (tiny-imagenet-200.zip as distributed by the CS231n course):

    wnids.txt                          200 WordNet ids, one a line
    train/<wnid>/images/<wnid>_<k>.JPEG  500 images per class (and <wnid>_boxes.txt, unused)
    val/images/val_<k>.JPEG            10,000 images
    val/val_annotations.txt            <file> TAB <wnid> TAB <bounding box ...>, one a line
    test/images/                       unlabelled, unused

Train is train/, test is val/ (the test/ split has no labels). The class index of a wnid is
its position in sorted(wnids.txt): the order torchvision's ImageFolder gives train/, so
labels agree with the usual PyTorch pipelines (wnids.txt itself is not sorted). Train
images are ordered by class, then by k within a class; test images follow the
annotation file. Every image is decoded with PIL to RGB (some are grayscale)
and must be 64x64.

Decoding 110,000 JPEGs takes about 20 s (5,700 images/s on one core here), in every run
and on every rank, so the arrays (1.35 GB) are cached as an uncompressed .npz in
`cache_dir`, named by a hash of every file's relative path, size and mtime (a changed,
added or removed file gives a new name; old entries are not deleted). The file is
written to a temporary name in the same folder and renamed (os.replace is atomic), so a
rank reading the cache never sees a partial file; ranks that start together before the
cache exists each decode and write the same file, which costs time but not correctness.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from fedmpi.errors import UsageError

FOLDER = "tiny-imagenet-200"
IMAGE_SIZE = 64
CACHE_VERSION = 1  # part of the cache key: bump when the arrays' meaning changes
HINT = "user-supplied: data_dir = tiny-imagenet-200/ (wnids.txt, train/, val/) or its parent"


def find_root(data_dir) -> Path | None:
    """data_dir itself or data_dir/tiny-imagenet-200, whichever holds wnids.txt (no reading)."""
    if not data_dir:
        return None
    base = Path(data_dir).expanduser()
    for candidate in (base, base / FOLDER):
        if (candidate / "wnids.txt").is_file():
            return candidate
    return None


def default_cache_dir() -> Path:
    return Path(os.environ.get("FEDMPI_CACHE") or "~/.cache/fedmpi").expanduser()


@dataclass
class Layout:
    """The image files in load order and their class indices."""

    root: Path
    wnids: list[str]  # sorted: class k is wnids[k]
    train_files: list[Path]
    train_labels: np.ndarray
    test_files: list[Path]
    test_labels: np.ndarray


def _jpegs(folder: Path) -> list[Path]:
    """The JPEGs of a folder, <prefix>_<k> ordered by k (same prefix: by length, then name)."""
    if not folder.is_dir():
        raise UsageError(f"{folder}: missing folder (expected the {FOLDER} layout)")
    files = [p for p in folder.iterdir() if p.suffix.lower() in (".jpeg", ".jpg")]
    if not files:
        raise UsageError(f"{folder}: no .JPEG images")
    return sorted(files, key=lambda p: (len(p.name), p.name))


def _read_wnids(root: Path) -> list[str]:
    wnids = (root / "wnids.txt").read_text().split()
    if not wnids or len(set(wnids)) != len(wnids):
        raise UsageError(f"{root / 'wnids.txt'}: needs distinct WordNet ids, one a line")
    return sorted(wnids)


def _read_val(root: Path, index: dict[str, int]) -> tuple[list[Path], np.ndarray]:
    """val/ images in annotation order with their labels; every file must exist."""
    path = root / "val" / "val_annotations.txt"
    if not path.is_file():
        raise UsageError(f"{path}: missing (expected the {FOLDER} layout)")
    present = {p.name for p in _jpegs(root / "val" / "images")}
    files, labels = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise UsageError(f"{path} line {number}: expected <file> TAB <wnid from wnids.txt>")
        if fields[0] not in present:
            raise UsageError(f"{root / 'val' / 'images' / fields[0]}: listed in {path.name} but missing")
        files.append(root / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    if not files:
        raise UsageError(f"{path}: no annotations")
    return files, np.array(labels, np.int64)


def read_layout(root: Path) -> Layout:
    """List (not decode) every train and val image; layout problems name the path."""
    wnids = _read_wnids(root)
    index = {w: k for k, w in enumerate(wnids)}
    per_class = [_jpegs(root / "train" / w / "images") for w in wnids]
    train_labels = np.repeat(np.arange(len(wnids), dtype=np.int64), [len(f) for f in per_class])
    test_files, test_labels = _read_val(root, index)
    return Layout(root, wnids, [p for files in per_class for p in files], train_labels,
                  test_files, test_labels)


def fingerprint(layout: Layout) -> str:
    """Hash of every input file's relative path, size and mtime, in load order."""
    digest = hashlib.sha256(f"tiny_imagenet v{CACHE_VERSION}\n".encode())
    extra = [layout.root / "wnids.txt", layout.root / "val" / "val_annotations.txt"]
    for path in extra + layout.train_files + layout.test_files:
        st = path.stat()
        digest.update(f"{path.relative_to(layout.root)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def decode(files: list[Path]) -> np.ndarray:
    """uint8 [N, 3, 64, 64] RGB, filled in place (no list of per-image arrays)."""
    from PIL import Image, UnidentifiedImageError   # deferred: for this dataset's JPEGs alone

    out = np.empty((len(files), 3, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    for i, path in enumerate(files):
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")  # grayscale (and CMYK) images become 3-channel
        except (OSError, UnidentifiedImageError) as err:
            raise UsageError(f"{path}: not a readable image ({err})") from None
        if rgb.size != (IMAGE_SIZE, IMAGE_SIZE):
            raise UsageError(f"{path}: image is {rgb.size[0]}x{rgb.size[1]}, expected 64x64")
        out[i] = np.asarray(rgb).transpose(2, 0, 1)
    return out


ARRAYS = ("train_x", "train_y", "test_x", "test_y", "mean", "std")


def _read_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None if absent or unreadable (then it is rebuilt)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in ARRAYS}
    except FileNotFoundError:
        return None
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        warnings.warn(f"{path}: unreadable cache ({err}); decoding the images again")
        return None


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Temporary file + os.replace: readers see the old file, or none, or the whole new one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as err:  # the cache only saves time: a read-only disk must not stop a run
        warnings.warn(f"cannot write the Tiny-ImageNet cache {path}: {err}")
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def load_arrays(root: Path, cache_dir: Path | None,
                stats: Callable[[np.ndarray], tuple[tuple, tuple]]) -> dict[str, np.ndarray]:
    """train/test arrays and channel `stats` (mean, std), from the cache when it is current.

    `cache_dir` None disables the cache. Returns the arrays named in ARRAYS.
    """
    layout = read_layout(root)
    path = cache_dir / f"tiny_imagenet-{fingerprint(layout)}.npz" if cache_dir else None
    arrays = _read_cache(path) if path else None
    if arrays is None:
        train_x = decode(layout.train_files)
        mean, std = stats(train_x)
        arrays = dict(train_x=train_x, train_y=layout.train_labels, test_x=decode(layout.test_files),
                      test_y=layout.test_labels, mean=np.array(mean), std=np.array(std))
        if path:
            _write_cache(path, arrays)
    return arrays
