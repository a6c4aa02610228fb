"""Sample-level DP-SGD's cost per local step: the same clients' local training with and
without ``privacy.mechanism = "sample"``.

Fashion-MNIST over 10 clients (IID, 6,000 samples each), all every round (cross-silo),
B = 32, E = 1, one round per run, one client after another; per model (the 2NN and the
McMahan CNN) a plain run, then a DP-SGD run (C = 1, sigma = 1), one after the other in
this process. Prints the seconds per local step of each (the round's compute time over
its steps) and their ratio. DP-SGD's batches are Poisson (expected size B), its gradient
is every sample's, clipped: the per-sample gradients are the whole difference.

    python benchmarks/privacy_sgd.py                    # both models
    python benchmarks/privacy_sgd.py --models 2nn --clients 4
    PYTHONPATH=/path/to/opacus python benchmarks/privacy_sgd.py --opacus

``--opacus`` also times Opacus (if it imports) on the same module, samples, B and
sigma: one epoch of one client's 6,000 samples as a plain PyTorch loop (shuffled batches
of 32), then through Opacus's PrivacyEngine with Poisson batches, per-sample gradients by
its hooks ("hooks") and by its ghost clipping ("ghost"); each as ms a step and as a ratio
to the plain loop, which is the overhead to compare with fedmpi's ratio.

What was measured, on which machine: docs/performance.md ("DP-SGD").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment


def workload(model: str, clients: int, private: bool) -> dict:
    values = {"name": "dpsgd", "seed": 0, "rounds": 1,
              "data": {"dataset": "fashion_mnist"}, "partition": {"kind": "iid"},
              "clients": {"num": clients, "per_round": clients},
              "model": {"name": model}, "algorithm": {"name": "fedavg"},
              "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
              "eval": {"every": 1, "at_start": False}, "system": {"client_group": 1}}
    if private:
        values["privacy"] = {"mechanism": "sample", "clip": 1.0, "noise_multiplier": 1.0}
    return values


def seconds_per_step(values: dict, out: Path) -> float:
    run_experiment(cfgmod.from_dict({**values, "output": str(out)}), LocalComm(), quiet=True)
    with RunFile(out) as run:
        compute = float(run.rounds()["time_compute"][-1])
        steps = int(run.clients()["steps"].sum())
    return compute / steps


def opacus_steps(model: str, samples: int = 6000, batch: int = 32) -> dict:
    """ms a step of the plain loop, Opacus "hooks" and Opacus "ghost" (see the docstring)."""
    import time

    import torch
    from opacus import PrivacyEngine   # optional: only --opacus needs it
    from torch.utils.data import DataLoader, TensorDataset

    from fedmpi.data.registry import load_dataset
    from fedmpi.models import build_model

    data = load_dataset("fashion_mnist")
    mean, std = torch.tensor(data.mean).view(1, -1, 1, 1), torch.tensor(data.std).view(1, -1, 1, 1)
    x = (data.train_x[:samples].float() / 255 - mean) / std
    dataset = TensorDataset(x, data.train_y[:samples].long())
    out = {}
    for mode in ("plain", "hooks", "ghost"):
        torch.manual_seed(0)
        module = build_model(model, 1, 10, 28)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
        loader = DataLoader(dataset, batch_size=batch, shuffle=True)
        criterion = torch.nn.CrossEntropyLoss()
        if mode != "plain":
            made = PrivacyEngine(accountant="rdp").make_private(
                module=module, optimizer=optimizer, data_loader=loader, criterion=criterion,
                noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True,
                grad_sample_mode=mode)
            module, optimizer, criterion, loader = made if mode == "ghost" else \
                (made[0], made[1], criterion, made[2])
        steps, start = 0, time.perf_counter()
        for xb, yb in loader:
            if not len(yb):
                continue
            optimizer.zero_grad()
            loss = criterion(module(xb), yb)
            loss.backward()
            optimizer.step()
            steps += 1
        out[mode] = 1e3 * (time.perf_counter() - start) / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["2nn", "cnn"])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--opacus", action="store_true",
                        help="also time Opacus on the same work (it must import)")
    args = parser.parse_args()
    print(f"DP-SGD: Fashion-MNIST, {args.clients} clients (IID), B = 32, E = 1, one client "
          f"after another; seconds per local step")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            plain = seconds_per_step(workload(model, args.clients, False),
                                     Path(tmp) / f"{model}-plain.h5")
            dp = seconds_per_step(workload(model, args.clients, True), Path(tmp) / f"{model}-dp.h5")
            print(f"  {model:4s}  plain {1e3 * plain:7.2f} ms   DP-SGD {1e3 * dp:7.2f} ms   "
                  f"ratio {dp / plain:.2f}", flush=True)
            if args.opacus:
                t = opacus_steps(model)
                print(f"  {model:4s}  Opacus: plain loop {t['plain']:7.2f} ms   hooks "
                      f"{t['hooks']:7.2f} ms (ratio {t['hooks'] / t['plain']:.2f})   ghost "
                      f"{t['ghost']:7.2f} ms (ratio {t['ghost'] / t['plain']:.2f})", flush=True)


if __name__ == "__main__":
    main()
