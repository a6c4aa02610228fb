"""What every runner of ``benchmarks/peers`` shares: the workload file, fedmpi's model, the
test score and the result line. Needs numpy and torch only (fedmpi's model modules need
nothing else), so it runs in each peer's own environment.

A runner is called as ``python run_X.py WORKLOAD.npz OUTDIR [--threads N]`` and prints one
JSON line: each training round's seconds, the SGD steps it took, the test accuracy of the
final model, and where it left the final parameters (``OUTDIR/X.npy``, in the model's
``state_dict`` order, flattened), which the driver compares with the bare loop's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


@dataclass
class Workload:
    meta: dict
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    lr: np.ndarray
    clients: np.ndarray     # [rounds, per_round]
    sizes: np.ndarray       # samples per client
    order: np.ndarray       # every (round, client)'s samples in batch order, concatenated
    offsets: np.ndarray
    init: dict              # parameter name -> initial tensor

    @property
    def rounds(self) -> int:
        return self.meta["rounds"]

    @property
    def batch_size(self) -> int:
        return self.meta["batch_size"]

    @property
    def grad_clip(self) -> float | None:
        return self.meta["grad_clip"] or None

    def samples(self, t: int, k: int) -> np.ndarray:
        """The samples of round t's k-th client, in fedmpi's batch order."""
        j = t * self.meta["per_round"] + k
        return self.order[self.offsets[j]:self.offsets[j + 1]]

    def client_data(self, t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(self.samples(t, k))
        return self.train_x[idx], self.train_y[idx]

    def build_model(self) -> torch.nn.Module:
        """fedmpi's model with the workload's initial parameters."""
        from fedmpi.models import build_model

        m = self.meta
        model = build_model(m["model"], m["in_channels"], m["num_classes"], m["image_size"],
                            **m["model_options"])
        model.load_state_dict(self.init)
        return model


def load(path: Path) -> Workload:
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    return Workload(meta, torch.from_numpy(z["train_x"]), torch.from_numpy(z["train_y"]),
                    torch.from_numpy(z["test_x"]), torch.from_numpy(z["test_y"]), z["lr"],
                    z["clients"], z["sizes"], z["order"], z["offsets"],
                    {k: torch.from_numpy(z[f"param:{k}"]) for k in meta["params"]})


_loaded: dict = {}


def load_once(path) -> Workload:
    """``load``, cached in this process: a simulator that runs clients in worker
    processes (Flower's Ray actors) reads the file once per worker, not once per client.
    Lives here, in an importable module, because functions defined in a runner's
    ``__main__`` travel to Ray's workers by value, with a fresh copy of their globals."""
    key = str(path)
    if key not in _loaded:
        _loaded[key] = load(Path(key))
    return _loaded[key]


def cli(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


@torch.no_grad()
def accuracy(model: torch.nn.Module, w: Workload, batch_size: int = 1000) -> float:
    model.eval()
    correct = sum(int((model(w.test_x[s:s + batch_size]).argmax(1) == w.test_y[s:s + batch_size]).sum())
                  for s in range(0, len(w.test_y), batch_size))
    return correct / len(w.test_y)


def flat(state: dict) -> np.ndarray:
    return torch.cat([torch.as_tensor(v).reshape(-1).float() for v in state.values()]).numpy()


def finish(name: str, args, w: Workload, model: torch.nn.Module, rounds: list[float],
           steps: int, **extra) -> None:
    """Score the final model, store its parameters, print the result line."""
    start = time.perf_counter()
    acc = accuracy(model, w)
    out = args.outdir / f"{name}.npy"
    np.save(out, flat(model.state_dict()))
    print(json.dumps({"runner": name, "rounds": rounds, "steps": steps, "acc": acc,
                      "score_s": time.perf_counter() - start, "params": str(out), **extra}))


def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)
