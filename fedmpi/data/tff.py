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
| tff_stackoverflow | ``stackoverflow_{train,test}.h5`` and ``stackoverflow.word_count`` | ``tokens`` [n] byte strings, a post's words joined by spaces (``title``, ``tags`` and the others are not read; nor is ``stackoverflow_held_out.h5``) |

The files' own split is kept: each client's test examples are its local test split under
``partition.kind = "natural"`` (CIFAR-100's 100 test clients are others than its 500
train clients, though their ids "0".."99" repeat train ids: they are the global test set
only). Shakespeare's snippets are joined per
client (a space between two) and cut into windows of ``seq_len`` characters and the one
that follows, every ``stride`` characters, as the ``shakespeare`` dataset does (LEAF's
80-letter ids). StackOverflow's posts become TFF's next-word task (fedmpi.data.words):
the first ``max_words`` (20) words of a post as ids of the ``vocab_size`` (10,000) most
frequent words, between a beginning and an end id, and each of its positions a sample: the
ids before it (right-padded with 0) and the id at it, which the lstm with ``pad_id = 0``
predicts exactly as TFF's masked sequence model does (10,004 ids and classes).
``max_clients = N`` reads the first N train clients only (h5py reads those groups and
nothing else) and only their test examples: the full file's 342,477 clients and 135
million posts make some two billion samples, over 100 GB as the cache's arrays (which
are built one client at a time and mapped, never held whole). The files' sha256 (and the word
counts') is the dataset's provenance. The Dataset is read once and kept as mapped .npy
files keyed by those digests and the options (fedmpi.data.cache), so later runs, and
every rank, map it instead of reading the HDF5 files again. A file of another task
(a feature missing), a label out of range, a client without examples or features of
unequal lengths: one line naming the file and the client.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np

from fedmpi.data import cache, shakespeare, words
from fedmpi.data.array_files import sha256
from fedmpi.data.natural import Builder
from fedmpi.data.registry import register
from fedmpi.errors import UsageError

FILES = {"emnist": "fed_emnist", "emnist_digits": "fed_emnist_digitsonly",
         "cifar100": "fed_cifar100", "shakespeare": "shakespeare",
         "stackoverflow": "stackoverflow"}
FEATURES = {"cifar100": ("image", "label"), "shakespeare": ("snippets",),
            "stackoverflow": ("tokens",)}
WORD_COUNTS = "stackoverflow.word_count"
CACHE_VERSION = 1


def files(data_dir, stem: str) -> tuple[Path, Path] | None:
    if not data_dir:
        return None
    folder = Path(data_dir).expanduser()
    pair = tuple(folder / f"{stem}_{split}.h5" for split in ("train", "test"))
    return pair if all(p.is_file() for p in pair) else None


def _clients(path: Path, features: tuple[str, ...], limit: int = 0, only: dict | None = None):
    """(name, features) of each client, one at a time: the first ``limit`` clients (0:
    all), or those named in ``only``; the others' groups are never read."""
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
        chosen = examples if only is None else [n for n in only if n in examples]
        for name in itertools.islice(chosen, limit or None):
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
            yield name, data


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


def _posts(path: Path, name: str, tokens, index: dict, max_words: int):
    xs, ys = [], []
    for post in tokens:
        try:
            text = post.decode("utf-8") if isinstance(post, bytes) else str(post)
        except UnicodeDecodeError:
            raise UsageError(f"TFF file {path}: client {name!r}: tokens are not UTF-8 "
                             f"text") from None
        x, y = words.next_word_windows(words.tff_post_ids(text, index, max_words), max_words)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def _source(kind: str, data_dir) -> tuple[tuple[Path, Path], list[Path], str]:
    """(the train and test files, every file read, their provenance line), or a one-line
    error."""
    stem = FILES[kind]
    pair = files(data_dir, stem)
    if pair is None:
        raise UsageError(f"dataset 'tff_{kind.split('_')[0]}': data_dir {data_dir} has no "
                         f"{stem}_train.h5 and {stem}_test.h5 (TensorFlow Federated's files)")
    provenance = [f"{stem}_*.h5 sha256 train {sha256(pair[0])}, test {sha256(pair[1])}"]
    read = list(pair)
    if kind == "stackoverflow":
        counts = pair[0].parent / WORD_COUNTS
        if not counts.is_file():
            raise UsageError(f"dataset 'tff_stackoverflow': data_dir {pair[0].parent} has no "
                             f"{WORD_COUNTS} (TFF's word counts, stackoverflow.word_count."
                             f"tar.bz2 unpacked beside the .h5 files)")
        provenance.append(f"{WORD_COUNTS} sha256 {sha256(counts)}")
        read.append(counts)
    return pair, read, f"{pair[0].parent} ({'; '.join(provenance)})"


SHAPES = {"emnist": (1, 28, 28), "emnist_digits": (1, 28, 28), "cifar100": (3, 32, 32)}


def load(name: str, kind: str, data_dir, classes: int, seq_len: int = 80, stride: int = 8,
         vocab_size: int = 10000, max_words: int = 20, max_clients: int = 0,
         source=None, folder: Path | None = None):
    """The Dataset, read one client at a time into a ``natural.Builder`` (into ``folder``,
    a cache being written, or into memory)."""
    pair, read, provenance = source or _source(kind, data_dir)
    features = FEATURES.get(kind, ("pixels", "label"))
    text = kind in ("shakespeare", "stackoverflow")
    if kind == "stackoverflow":
        index = {w: i for i, w in enumerate(words.tff_vocabulary(read[2], vocab_size))}
    x_dtype = words.id_dtype(classes) if kind == "stackoverflow" else np.uint8
    x_shape = SHAPES.get(kind) or ((seq_len,) if kind == "shakespeare" else (max_words,))
    out = Builder(folder, x_dtype, x_shape, not text)
    index_of: dict[str, int] = {}
    try:
        for split, path in zip(("train", "test"), pair):
            for name, data in _clients(path, features, max_clients if split == "train" else 0,
                                       index_of if split == "test" and max_clients else None):
                if kind == "shakespeare":
                    x, y = _windows(path, name, data["snippets"], seq_len, stride)
                elif kind == "stackoverflow":
                    x, y = _posts(path, name, data["tokens"], index, max_words)
                else:
                    x = _images(kind, path, name, data)
                    y = _labels(path, name, data["label"], classes)
                if split == "train":
                    if len(y):
                        index_of[name] = len(index_of)
                    out.train(index_of.get(name, -1), x, y)
                else:   # CIFAR-100's test clients reuse train ids "0".."99" for other people
                    out.test(index_of.get(name, -1) if kind != "cifar100" else -1, x, y)
        return out.finish(name, classes if kind != "shakespeare" else shakespeare.VOCAB_SIZE,
                          provenance, list(index_of))
    except BaseException:
        out.close()
        raise


def _dataset(name: str, kind: str, data_dir, classes: int, **options):
    """The Dataset, from its cache (read once, then mapped: fedmpi.data.cache), keyed by
    the files' digests and the options."""
    source = _source(kind, data_dir)
    key = hashlib.sha256(json.dumps([source[2], kind, classes, sorted(options.items())])
                         .encode()).hexdigest()[:24]
    where = cache.root(source[0][0].parent)

    return cache.keep(where and where / f"{name}-v{CACHE_VERSION}-{key}",
                      lambda folder: load(name, kind, data_dir, classes, **options,
                                          source=source, folder=folder))


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


@register("tff_stackoverflow", modality="text", locate=_locate("stackoverflow"),
          client_tests=True, hint=_HINT.format("stackoverflow", "stackoverflow")
          + " and stackoverflow.word_count")
def load_tff_stackoverflow(data_dir=None, seed=0, vocab_size=10000, max_words=20,
                           max_clients=0):
    """TFF's StackOverflow: next-word prediction, one client per user (342,477)."""
    for field, value, low, high in (("vocab_size", vocab_size, 1, 2 ** 20 - 4),
                                    ("max_words", max_words, 1, 1000),
                                    ("max_clients", max_clients, 0, 2 ** 31)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UsageError(f"config field data.{field}: an integer in {low}..{high}"
                             + (" (0: every client)" if field == "max_clients" else ""))
    return _dataset("tff_stackoverflow", "stackoverflow", data_dir, vocab_size + 4,
                    vocab_size=vocab_size, max_words=max_words, max_clients=max_clients)
