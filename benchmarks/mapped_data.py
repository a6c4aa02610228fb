"""What a rank holds of a benchmark dataset: mapped from the cache against in memory.

Writes a TFF EMNIST file of ``--clients`` writers with ``--per-client`` 28x28 images each
(MNIST-5k digits repeated: tools/tff_fixtures.py's layout), reads it once to build the
cache (fedmpi.data.cache), then, each in a fresh process: loads it mapped and loads it in
memory (no cache), and prints each load's seconds and the growth of the process's peak
resident memory (ru_maxrss), then the same after reading one client's samples, as a
worker that trains it does:

    python benchmarks/mapped_data.py                       # 3,400 writers x 300 images
    python benchmarks/mapped_data.py --clients 1000 --per-client 100
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, resource, sys, time
import numpy as np
from fedmpi.data import cache, load_dataset
if sys.argv[2] == "memory":
    cache.root = lambda folder: None
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base, t = rss(), time.perf_counter()
ds = load_dataset("tff_emnist", sys.argv[1])
seconds, loaded = time.perf_counter() - t, rss() - base
mine = np.flatnonzero(ds.groups.numpy() == 0)
touched = float(ds.train_x[mine].float().mean())   # a worker reads its client's samples
print(json.dumps({"way": sys.argv[2], "seconds": round(seconds, 2), "mb_after_load":
                  round(loaded), "mb_after_one_client": round(rss() - base),
                  "train_mb": round(ds.train_x.numel() / 2 ** 20), "mapped": bool(ds.mapped_from)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3400)
    parser.add_argument("--per-client", type=int, default=300)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tools"))
    import h5py
    import numpy as np
    import tff_fixtures

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small = tff_fixtures.write_emnist(folder / "seed", clients=10, per_client=50)
        with h5py.File(small / "fed_emnist_train.h5") as h5:
            pixels = np.concatenate([g["pixels"][()] for g in h5["examples"].values()])
            labels = np.concatenate([g["label"][()] for g in h5["examples"].values()])
        for split, n in (("train", args.per_client), ("test", max(1, args.per_client // 10))):
            with h5py.File(folder / f"fed_emnist_{split}.h5", "w") as h5:
                for c in range(args.clients):
                    pick = (np.arange(n) + c * 7) % len(labels)
                    group = h5.create_group(f"examples/f{c:05d}_00")
                    group.create_dataset("pixels", data=pixels[pick])
                    group.create_dataset("label", data=labels[pick])
        run = [sys.executable, "-c", PROBE, str(folder)]
        build = json.loads(subprocess.run(run + ["build"], capture_output=True, text=True,
                                          check=True, cwd=ROOT).stdout)
        print(json.dumps({"clients": args.clients, "per_client": args.per_client,
                          "building the cache": build}))
        for way in ("mapped", "memory"):
            print(subprocess.run(run + [way], capture_output=True, text=True, check=True,
                                 cwd=ROOT).stdout.strip())


if __name__ == "__main__":
    main()
