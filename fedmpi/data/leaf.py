"""LEAF's benchmark files (Caldas et al., "LEAF: A Benchmark for Federated Settings",
arXiv:1812.01097) as their users have them on disk: ``data.dataset = "leaf_femnist" |
"leaf_shakespeare" | "leaf_celeba"``, ``data.data_dir`` = the dataset's LEAF ``data/``
folder after ``preprocess.sh`` (its ``train/`` and ``test/`` folders of JSON shards;
CelebA's images in ``raw/img_align_celeba/``). Any sampled subset LEAF's ``--sf`` made
loads as it is.

A shard is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...],
"y": [...]}}}`` (LEAF's data_to_json / split_data). The users of the train shards, in
the order the shards (sorted by name) list them, are the natural clients
(``partition.kind = "natural"``: ``groups`` per train sample, ``group_names`` the user
ids); the test shards are the test set, and each test sample keeps its user
(``test_groups``, -1 for a user without training data: LEAF's ``-t user`` split). What
``x`` holds, per dataset:

- FEMNIST: 784 values in [0, 1], a 28x28 grey image / 255 (white paper is 1.0, as LEAF
  writes it: nothing is inverted), stored as uint8 round(255 x); 62 classes (0-9, A-Z,
  a-z).
- Shakespeare: strings of 80 characters, the label the next character; ids are LEAF's
  80 letters (ALL_LETTERS, fedmpi.data.shakespeare), any other character id 80.
- CelebA: image file names in ``raw/img_align_celeba``, resized to 84x84 RGB as LEAF's
  model reads them; the label is smiling (0/1).
- Sent140: a tweet's raw row (``x[4]`` the text, as LEAF's model reads it), the label
  its sentiment (0/1; LEAF's ``int(y)``); the first ``max_words`` (25) tokens as ids of
  LEAF's embs.json vocabulary (``vocab_file``) or, without it, of the ``vocab_size``
  (10,000) most frequent tokens of the training tweets, unknown words and padding
  ``len(vocab)`` (fedmpi.data.words).

Parsing JSON is slow for the full sets (FEMNIST's 3,500 writers are ~2.5 GB of text), so
the shards are read one at a time, each user's samples written into the Dataset's .npy
files (fedmpi.data.natural), which are kept in a cache keyed by the shards' sha256
(``.fedmpi-cache/`` in the data folder, else in ``~/.cache/fedmpi``) and mapped from there
while the shards are unchanged (fedmpi.data.cache: a rank holds only the pages its clients
read); the digest is the dataset's provenance (``source``). Every problem with a
shard is one line naming the file: not JSON, a key missing, a user listed without data,
``num_samples`` that disagrees with the data, a sample of the wrong shape, a label out
of range.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from fedmpi.data import cache, shakespeare, words
from fedmpi.data.natural import Builder
from fedmpi.data.registry import register
from fedmpi.data.sources import Dataset
from fedmpi.errors import UsageError

KINDS = {"femnist": 62, "shakespeare": shakespeare.VOCAB_SIZE, "celeba": 2, "sent140": 2}
CELEBA_SIZE = 84
CACHE_VERSION = 2   # 2: the Dataset's arrays as mapped .npy files (fedmpi.data.cache)


def leaf_dir(data_dir) -> Path | None:
    """The LEAF ``data/`` folder: ``data_dir`` itself, or its ``data/`` child."""
    if not data_dir:
        return None
    root = Path(data_dir).expanduser()
    for folder in (root, root / "data"):
        if (folder / "train").is_dir() and (folder / "test").is_dir():
            return folder
    return None


def _source(kind: str, data_dir, vocab_file: str = "") -> tuple[Path, dict, Path | None, str]:
    """(the LEAF data/ folder, its train and test shards, the vocabulary file, the
    digest of them all), or a one-line error."""
    folder = leaf_dir(data_dir)
    if folder is None:
        raise UsageError(f"dataset 'leaf_{kind}': data_dir {data_dir} is not a LEAF data/ "
                         f"folder (train/ and test/ of JSON shards, as preprocess.sh writes "
                         f"them; data_dir may also be their parent)")
    shards = {split: sorted((folder / split).glob("*.json")) for split in ("train", "test")}
    for split, files in shards.items():
        if not files:
            raise UsageError(f"dataset 'leaf_{kind}': {folder / split} holds no .json shard")
    vocab = Path(vocab_file).expanduser() if vocab_file else None
    if vocab is not None and not vocab.is_file():
        raise UsageError(f"config field data.vocab_file: {vocab} is not a file (LEAF's "
                         f"models/sent140/embs.json; \"\" builds the vocabulary from the tweets)")
    return folder, shards, vocab, _digest(shards["train"] + shards["test"] + ([vocab] if vocab else []))


SHAPES = {"femnist": (1, 28, 28), "shakespeare": (80,), "celeba": (3, CELEBA_SIZE, CELEBA_SIZE)}


def load(name: str, kind: str, data_dir, vocab_file: str = "", vocab_size: int = 10000,
         max_words: int = 25, folder: Path | None = None) -> Dataset:
    """The Dataset of one LEAF dataset, one shard in memory at a time, each user's samples
    into a ``natural.Builder`` (into ``folder``, a cache being written, or into memory):
    the train shards' users in order are the natural clients (``groups``), every test
    sample is in the global test set, and those of users who also train are their local
    test split (``held_out``)."""
    root, shards, vocab, digest = _source(kind, data_dir, vocab_file)
    known = None
    if kind == "sent140":   # ids once the vocabulary is known: GloVe's or the train tweets'
        known = words.leaf_vocabulary(vocab) if vocab else words.built_vocabulary(
            (t for path, user, x, _ in _users(shards["train"])
             for t in _inputs(kind, root, x, f"LEAF file {path}: user {user!r}")), vocab_size)
    x_dtype = words.id_dtype(len(known) + 1) if known is not None else np.uint8
    out = Builder(folder, x_dtype, SHAPES.get(kind, (max_words,)), kind in ("femnist", "celeba"))
    index: dict[str, int] = {}
    try:
        for split in ("train", "test"):
            for path, user, x, y in _users(shards[split]):
                where = f"LEAF file {path}: user {user!r}"
                x, y = _inputs(kind, root, x, where), _labels(kind, y, where)
                if known is not None:
                    x = words.leaf_ids(x, known, max_words)
                if split == "train":
                    index[user] = len(index)
                    out.train(index[user], x, y)
                else:
                    out.test(index.get(user, -1), x, y)
        return out.finish(name, KINDS[kind], f"{root} (LEAF shards sha256 {digest})",
                          list(index), None if known is None else len(known) + 1)
    except BaseException:
        out.close()
        raise


def _digest(files: list[Path]) -> str:
    sha = hashlib.sha256()
    for path in files:
        sha.update(f"{path.parent.name}/{path.name}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                sha.update(block)
    return sha.hexdigest()


def _users(files: list[Path]):
    """(shard, user, x, y) of every user of ``files``, one shard in memory at a time; a
    user listed without data, with x and y of other lengths than num_samples, or in two
    shards is a one-line error naming the shard."""
    seen: dict[str, Path] = {}
    for path in files:
        shard = _shard(path)
        for user, count in zip(shard["users"], shard["num_samples"]):
            if user in seen:
                raise UsageError(f"LEAF file {path}: user {user!r} is also in {seen[user]}")
            seen[user] = path
            data = shard["user_data"].get(user)
            if not isinstance(data, dict) or "x" not in data or "y" not in data:
                raise UsageError(f"LEAF file {path}: user {user!r} is listed in users but has "
                                 f"no x and y in user_data")
            x, y = data["x"], data["y"]
            if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y):
                raise UsageError(f"LEAF file {path}: user {user!r}: x and y must be lists of "
                                 f"one length")
            if len(y) != count:
                raise UsageError(f"LEAF file {path}: user {user!r} has {len(y)} samples, "
                                 f"num_samples says {count}")
            yield path, user, x, y


def _shard(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            shard = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"LEAF file {path} is not valid JSON ({exc}); truncated or "
                         f"damaged? preprocess.sh writes it again") from None
    except OSError as exc:
        raise UsageError(f"LEAF file {path} cannot be read ({exc.strerror})") from None
    if not isinstance(shard, dict) or not {"users", "num_samples", "user_data"} <= set(shard):
        raise UsageError(f"LEAF file {path}: not a LEAF shard (it needs users, num_samples "
                         f"and user_data)")
    users, counts, data = shard["users"], shard["num_samples"], shard["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts) \
            or not isinstance(data, dict) or not all(isinstance(u, str) for u in users) \
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise UsageError(f"LEAF file {path}: users (strings) and num_samples (counts) must be "
                         f"lists of one length, user_data a table")
    if len(set(users)) != len(users):
        raise UsageError(f"LEAF file {path}: a user is listed twice in users")
    return shard


def _inputs(kind: str, folder: Path, x: list, where: str) -> np.ndarray:
    if kind == "femnist":
        try:
            pixels = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
        except (ValueError, TypeError):
            raise UsageError(f"{where}: each x must be 784 values in [0, 1] (a 28x28 image / "
                             f"255); rows of other lengths, or not numbers, found") from None
        if len(x) and (pixels.shape[1] != 784 or not np.isfinite(pixels).all()
                       or pixels.min() < 0 or pixels.max() > 1):
            raise UsageError(f"{where}: each x must be 784 values in [0, 1] (a 28x28 image / "
                             f"255), got {pixels.shape[1]} values in "
                             f"[{pixels.min():.3g}, {pixels.max():.3g}]")
        return np.rint(pixels * 255).astype(np.uint8).reshape(len(x), 1, 28, 28)
    if kind == "sent140":
        if not all(isinstance(row, list) and len(row) > 4 and isinstance(row[4], str) for row in x):
            raise UsageError(f"{where}: each x must be a tweet's row with its text at x[4] "
                             f"(LEAF's [id, date, query, user, text])")
        return np.array([row[4] for row in x], dtype=object)
    if kind == "shakespeare":
        if not all(isinstance(s, str) and len(s) == 80 for s in x):
            raise UsageError(f"{where}: each x must be a string of 80 characters")
        return np.stack([shakespeare.encode(s) for s in x]) if x else np.zeros((0, 80), np.uint8)
    return _celeba_images(folder, x, where)


def _labels(kind: str, y: list, where: str) -> np.ndarray:
    if kind == "shakespeare":
        if not all(isinstance(c, str) and len(c) == 1 for c in y):
            raise UsageError(f"{where}: each y must be one character (the next one)")
        return shakespeare.encode("".join(y)).astype(np.int64) if y else np.zeros(0, np.int64)
    if kind == "sent140" and all(isinstance(c, str) and c.isdigit() for c in y):
        y = [int(c) for c in y]   # LEAF's process_y: int(y)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in y):
        raise UsageError(f"{where}: each y must be an integer label")
    labels = np.asarray(y, dtype=np.int64)
    outside = labels[(labels < 0) | (labels >= KINDS[kind])]
    if len(outside):
        raise UsageError(f"{where}: label {int(outside[0])} is outside 0..{KINDS[kind] - 1}")
    return labels


def _celeba_images(folder: Path, names: list, where: str) -> np.ndarray:
    from PIL import Image   # deferred: Pillow (torchvision's), for CelebA alone

    images = folder / "raw" / "img_align_celeba"
    out = np.empty((len(names), 3, CELEBA_SIZE, CELEBA_SIZE), dtype=np.uint8)
    for i, name in enumerate(names):
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise UsageError(f"{where}: x must be image file names in {images}")
        try:
            with Image.open(images / name) as img:
                picture = img.convert("RGB").resize((CELEBA_SIZE, CELEBA_SIZE))
        except OSError as exc:
            raise UsageError(f"{where}: image {images / name} cannot be read "
                             f"({exc.strerror or exc})") from None
        out[i] = np.asarray(picture, dtype=np.uint8).transpose(2, 0, 1)
    return out


# ---- the registered datasets ------------------------------------------------------------

def _dataset(kind: str, data_dir, **options):
    """The Dataset, from its cache (parsed once, then mapped: fedmpi.data.cache)."""
    folder, _, vocab, digest = _source(kind, data_dir, options.get("vocab_file", ""))
    tag = kind if kind != "sent140" else \
        f"{kind}-{options['vocab_size'] if vocab is None else 'embs'}-{options['max_words']}"
    where = cache.root(folder)
    return cache.keep(where and where / f"leaf_{tag}-v{CACHE_VERSION}-{digest[:24]}",
                      lambda into: load(f"leaf_{kind}", kind, data_dir, **options, folder=into))


_HINT = ("user-supplied: data_dir = LEAF's data/ folder of the dataset after preprocess.sh "
         "(train/ and test/ JSON shards{})")


@register("leaf_femnist", locate=leaf_dir, hint=_HINT.format(""), client_tests=True)
def load_leaf_femnist(data_dir=None, seed=0):
    """LEAF FEMNIST: 28x28 handwritten characters of 62 classes, one client per writer."""
    return _dataset("femnist", data_dir)


@register("leaf_shakespeare", modality="text", locate=leaf_dir, hint=_HINT.format(""),
          client_tests=True)
def load_leaf_shakespeare(data_dir=None, seed=0):
    """LEAF Shakespeare: the next character after 80, one client per (play, role)."""
    return _dataset("shakespeare", data_dir)


@register("leaf_celeba", locate=leaf_dir,
          hint=_HINT.format("; the images in raw/img_align_celeba/"), client_tests=True)
def load_leaf_celeba(data_dir=None, seed=0):
    """LEAF CelebA: 84x84 faces, smiling or not, one client per celebrity."""
    return _dataset("celeba", data_dir)


@register("leaf_sent140", modality="text", locate=leaf_dir, hint=_HINT.format(""),
          client_tests=True)
def load_leaf_sent140(data_dir=None, seed=0, vocab_file="", vocab_size=10000, max_words=25):
    """LEAF Sent140: a tweet's sentiment from its first 25 words, one client per user."""
    if not isinstance(vocab_file, str):
        raise UsageError("config field data.vocab_file: a path to LEAF's embs.json, or \"\"")
    for field, value, high in (("vocab_size", vocab_size, 2 ** 20 - 1), ("max_words", max_words, 1000)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise UsageError(f"config field data.{field}: an integer in 1..{high}")
    return _dataset("sent140", data_dir, vocab_file=vocab_file, vocab_size=vocab_size,
                    max_words=max_words)
