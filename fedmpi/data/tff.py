"""TensorFlow Federated's HDF5 files, as FL codebases keep them on disk (FedML, FedLab and
Flower's baselines read the same files): ``data.dataset = "tff_emnist" | "tff_cifar100" |
"tff_shakespeare"``, ``data.data_dir`` = the folder holding the train and test files.

Every file has one group per client under ``examples/`` (h5py lists them in name order:
the natural clients' order), each with one dataset per feature:

| dataset | files | features |
|---|---|---|
| tff_emnist | ``fed_emnist_{train,test}.h5`` (62 classes); with ``only_digits = true`` ``fed_emnist_digitsonly_{train,test}.h5`` (10) | ``pixels`` float32 [n, 28, 28] in [0, 1], 1.0 the background (stored as uint8 round(255 x), not inverted); ``label`` [n] |
| tff_cifar100 | ``fed_cifar100_{train,test}.h5`` | ``image`` uint8 [n, 32, 32, 3]; ``label`` [n], the 100 fine classes |
| tff_shakespeare | ``shakespeare_{train,test}.h5`` | ``snippets`` [n] byte strings, a client's lines |

The files' own split is kept: each client's test examples are its local test split under
``partition.kind = "natural"`` (CIFAR-100's 100 test clients are others than its 500
train clients, though their ids "0".."99" repeat train ids: they are the global test set
only). Shakespeare's snippets are joined per
client (a space between two) and cut into windows of ``seq_len`` characters and the one
that follows, every ``stride`` characters, as the ``shakespeare`` dataset does (LEAF's
80-letter ids). The files' sha256 is the dataset's provenance. A file of another task
(a feature missing), a label out of range, a client without examples or features of
unequal lengths: one line naming the file and the client.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmpi.data import shakespeare
from fedmpi.data.array_files import sha256
from fedmpi.data.leaf import natural_dataset
from fedmpi.data.registry import register
from fedmpi.errors import UsageError

FILES = {"emnist": "fed_emnist", "emnist_digits": "fed_emnist_digitsonly",
         "cifar100": "fed_cifar100", "shakespeare": "shakespeare"}


def files(data_dir, stem: str) -> tuple[Path, Path] | None:
    if not data_dir:
        return None
    folder = Path(data_dir).expanduser()
    pair = tuple(folder / f"{stem}_{split}.h5" for split in ("train", "test"))
    return pair if all(p.is_file() for p in pair) else None


def _read(path: Path, features: tuple[str, ...]) -> tuple[list[str], list[dict]]:
    import h5py   # deferred: h5py with the data module's other readers, at load time only

    try:
        h5 = h5py.File(path, "r")
    except OSError as exc:
        raise UsageError(f"TFF file {path} is not a readable HDF5 file ({exc})") from None
    with h5:
        examples = h5.get("examples")
        if not isinstance(examples, h5py.Group):
            raise UsageError(f"TFF file {path}: no examples/ group (TFF's client data files "
                             f"hold examples/<client>/<feature>)")
        names, clients = [], []
        for name in examples:
            group = examples[name]
            missing = [f for f in features if f not in group]
            if missing:
                raise UsageError(f"TFF file {path}: client {name!r} has no {', '.join(missing)} "
                                 f"(features: {', '.join(sorted(group)) or 'none'}); a file of "
                                 f"another task?")
            data = {f: group[f][()] for f in features}
            lengths = {len(v) for v in data.values()}
            if lengths == {0} or len(lengths) != 1:
                raise UsageError(f"TFF file {path}: client {name!r} has no examples, or "
                                 f"features of unequal lengths")
            names.append(name)
            clients.append(data)
    return names, clients


def _labels(path: Path, name: str, y, classes: int) -> np.ndarray:
    y = np.asarray(y)
    if y.dtype.kind not in "iu" or (len(y) and (y.min() < 0 or y.max() >= classes)):
        raise UsageError(f"TFF file {path}: client {name!r}: labels must be integers in "
                         f"0..{classes - 1}")
    return y.astype(np.int64)


def _images(kind: str, path: Path, name: str, data: dict) -> np.ndarray:
    if kind == "cifar100":
        x = data["image"]
        if x.dtype != np.uint8 or x.shape[1:] != (32, 32, 3):
            raise UsageError(f"TFF file {path}: client {name!r}: image must be uint8 "
                             f"[n, 32, 32, 3], got {x.dtype} {list(x.shape)}")
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    x = np.asarray(data["pixels"], dtype=np.float64)
    if x.shape[1:] != (28, 28) or not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
        raise UsageError(f"TFF file {path}: client {name!r}: pixels must be [n, 28, 28] in "
                         f"[0, 1]")
    return np.rint(x * 255).astype(np.uint8)[:, None]


def _windows(path: Path, name: str, snippets, seq_len: int, stride: int):
    try:
        text = " ".join(s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in snippets)
    except UnicodeDecodeError:
        raise UsageError(f"TFF file {path}: client {name!r}: snippets are not UTF-8 text") from None
    ids = shakespeare.encode(text)
    starts = np.arange(0, max(len(ids) - seq_len, 0), stride)
    x = np.stack([ids[s:s + seq_len] for s in starts]) if len(starts) else \
        np.zeros((0, seq_len), np.uint8)
    return x, ids[starts + seq_len].astype(np.int64)


def load(kind: str, data_dir, classes: int, seq_len: int = 80, stride: int = 8) -> dict:
    stem = FILES[kind]
    pair = files(data_dir, stem)
    if pair is None:
        raise UsageError(f"dataset 'tff_{kind.split('_')[0]}': data_dir {data_dir} has no "
                         f"{stem}_train.h5 and {stem}_test.h5 (TensorFlow Federated's files)")
    features = {"cifar100": ("image", "label"), "shakespeare": ("snippets",)}.get(
        kind, ("pixels", "label"))
    out, index = {}, {}
    for split, path in zip(("train", "test"), pair):
        names, clients = _read(path, features)
        xs, ys, owners = [], [], []
        for name, data in zip(names, clients):
            if kind == "shakespeare":
                x, y = _windows(path, name, data["snippets"], seq_len, stride)
            else:
                x, y = _images(kind, path, name, data), _labels(path, name, data["label"], classes)
            if split == "train" and len(y):
                index[name] = len(index)
            xs.append(x)
            ys.append(y)
            # CIFAR-100's test clients reuse the train ids "0".."99" for other people
            same = split == "train" or kind != "cifar100"
            owners.append(np.full(len(y), index.get(name, -1) if same else -1, dtype=np.int64))
        out[f"{split}_x"], out[f"{split}_y"] = np.concatenate(xs), np.concatenate(ys)
        out["groups" if split == "train" else "test_groups"] = np.concatenate(owners)
    out["names"] = list(index)
    train, test = (sha256(p) for p in pair)
    out["source"] = f"{pair[0].parent} ({stem}_*.h5 sha256 train {train}, test {test})"
    return out


def _dataset(name: str, kind: str, data_dir, classes: int, **options):
    a = load(kind, data_dir, classes, **options)
    return natural_dataset(name, a, classes if kind != "shakespeare" else shakespeare.VOCAB_SIZE,
                           kind == "shakespeare", a["source"])


def _locate(stem: str):
    return lambda data_dir: (files(data_dir, stem) or (None,))[0]


_HINT = "user-supplied: data_dir = the folder of TensorFlow Federated's {}_train.h5 and {}_test.h5"


@register("tff_emnist", locate=_locate("fed_emnist"), client_tests=True,
          hint=_HINT.format("fed_emnist", "fed_emnist") + " (only_digits: fed_emnist_digitsonly)")
def load_tff_emnist(data_dir=None, seed=0, only_digits=False):
    """TFF's federated EMNIST: 3,400 writers, 62 classes (only_digits: 3,383, 10)."""
    if only_digits:
        return _dataset("tff_emnist", "emnist_digits", data_dir, 10)
    return _dataset("tff_emnist", "emnist", data_dir, 62)


@register("tff_cifar100", locate=_locate("fed_cifar100"), client_tests=True,
          hint=_HINT.format("fed_cifar100", "fed_cifar100"))
def load_tff_cifar100(data_dir=None, seed=0):
    """TFF's federated CIFAR-100: 500 train and 100 test clients by Pachinko allocation."""
    return _dataset("tff_cifar100", "cifar100", data_dir, 100)


@register("tff_shakespeare", modality="text", locate=_locate("shakespeare"), client_tests=True,
          hint=_HINT.format("shakespeare", "shakespeare"))
def load_tff_shakespeare(data_dir=None, seed=0, seq_len=80, stride=8):
    """TFF's Shakespeare: 715 (play, role) clients' lines, next-character windows."""
    if not (isinstance(seq_len, int) and 1 <= seq_len <= 1000 and isinstance(stride, int)
            and 1 <= stride <= 1000):
        raise UsageError("config fields data.seq_len and data.stride: integers in 1..1000")
    return _dataset("tff_shakespeare", "shakespeare", data_dir, 0, seq_len=seq_len, stride=stride)
