"""Build tiny CIFAR-10/100 fixtures in the original python-pickle format (tests/data/).

The real batches were written by Python 2's cPickle (protocol 2): keys and strings are
py2 `str` (SHORT_BINSTRING/BINSTRING opcodes, read back as bytes with encoding="bytes")
and arrays reference `numpy.core.multiarray._reconstruct`. This script writes exactly
that, so the loader is tested on what users have on disk. Images are synthesised with
numpy (a class-dependent colour gradient plus noise); nothing is downloaded.

    python tools/make_cifar_fixture.py [tests/data]
"""

import pickle
import struct
import sys
from pathlib import Path

import numpy as np


class Py2Pickler(pickle._Pickler):
    """Pure-python pickler that writes str/bytes and numpy globals as Python 2 did."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        data = obj.encode("latin-1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)


def images(rng, labels, num_classes):
    """[n, 3072] uint8 rows (R, G, B planes) with a class-dependent gradient."""
    ramp = np.linspace(0, 1, 32)[None, :] + np.linspace(0, 1, 32)[:, None]
    hue = np.stack([np.cos(2 * np.pi * (labels / num_classes + k / 3)) for k in range(3)], 1)
    x = 128 + 60 * hue[:, :, None, None] * ramp + rng.normal(0, 20, (len(labels), 3, 32, 32))
    return np.clip(x, 0, 255).astype(np.uint8).reshape(len(labels), 3072)


def write(path, obj):
    with open(path, "wb") as f:
        Py2Pickler(f, protocol=2).dump(obj)


def cifar10(root, rng, per_batch=8, test=20):
    out = root / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    write(out / "batches.meta",
          {"num_cases_per_batch": per_batch, "label_names": names, "num_vis": 3072})
    batches = [(f"data_batch_{i}", f"training batch {i} of 5", per_batch) for i in range(1, 6)]
    for fname, label, n in batches + [("test_batch", "testing batch 1 of 1", test)]:
        y = [int(v) for v in rng.integers(0, 10, n)]
        write(out / fname, {"batch_label": label, "labels": y, "data": images(rng, np.array(y), 10),
                            "filenames": [f"fixture_{fname}_{j}.png" for j in range(n)]})


def cifar100(root, rng, train=40, test=20):
    out = root / "cifar-100-python"
    out.mkdir(parents=True, exist_ok=True)
    write(out / "meta", {"fine_label_names": [f"fine_{i}" for i in range(100)],
                         "coarse_label_names": [f"coarse_{i}" for i in range(20)]})
    for fname, n in (("train", train), ("test", test)):
        fine = [int(v) for v in rng.integers(0, 100, n)]
        write(out / fname, {"filenames": [f"fixture_{fname}_{j}.png" for j in range(n)],
                            "batch_label": f"{fname}ing batch 1 of 1", "fine_labels": fine,
                            "coarse_labels": [v // 5 for v in fine],
                            "data": images(rng, np.array(fine), 100)})


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data")
    cifar10(root, np.random.default_rng(10))
    cifar100(root, np.random.default_rng(100))
