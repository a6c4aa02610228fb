"""Data poisoning (``[attack]`` kinds ``label_flip`` and ``backdoor``): what a malicious
identity's training batches carry, an attribute of the identity as its feature skew is,
applied on the device to each batch it draws (never to the shared training tensors).

- ``label_flip``: every label through a map, y -> C - 1 - y (``target`` = -1) or y ->
  ``target``;
- ``backdoor`` (the pixel-pattern trigger of Gu et al. 2017 / Bagdasaryan et al. 2020): a
  keyed share ``poison_fraction`` of the client's samples (the first of a permutation of
  its samples keyed by (seed, "backdoor", client), the same every round) carry a white
  ``trigger`` x ``trigger`` square in the bottom-right corner and the label ``target``.

The attack's success is scored on the global test set after every evaluation
(``AttackSuccess``, /rounds ``attack_success``): the share of the test samples the
attack would move (a backdoor: those whose label is not the target, each with the trigger;
a label map: those it does not leave in place) that the global model classifies as the
attacker's label.

A poisoned client always takes the per-client batch path: the client groups' gathered
batches read one label tensor for the whole group and would skip the map.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..config.coerce import field_error
from ..evaluation import chunks_of
from .attacks import malicious
from .rng import torch_generator

KINDS = ("label_flip", "backdoor")


def label_map(num_classes: int, target: int, device) -> torch.Tensor:
    classes = torch.arange(num_classes, device=device)
    return num_classes - 1 - classes if target < 0 else torch.full_like(classes, target)


def stamp(x: torch.Tensor, size: int) -> None:
    """The trigger into uint8 images [B, C, H, W], in place."""
    x[:, :, x.shape[2] - size:, x.shape[3] - size:] = 255


def poisoning(config, dataset, device, supervised: bool) -> "Poisoning | None":
    """The run's data attack, or None."""
    return Poisoning(config, dataset, device, supervised) if config.attack.kind in KINDS \
        else None


class Poisoning:
    """The run's data attack: ``client(c, indices)`` gives identity c's poison (None for
    an honest client). Checked against the dataset at start-up (one line, exit 2)."""

    def __init__(self, config, dataset, device, supervised: bool):
        a = config.attack
        self.kind, self.target, self.size = a.kind, a.target, a.trigger
        self.fraction, self.seed = a.poison_fraction, config.seed
        self.ids = set(malicious(config).tolist())
        classes = dataset.num_classes
        if not supervised:
            raise field_error("attack.kind", f"{a.kind!r} poisons labels; algorithm "
                                             f"{config.algorithm.name!r} trains without them")
        if a.target >= classes:
            raise field_error("attack.target", f"must be -1 or a class in [0, {classes}) of "
                                               f"{config.data.dataset!r}, got {a.target}")
        if self.kind == "backdoor":
            shape = tuple(dataset.train_x.shape[2:])
            if getattr(dataset, "modality", "image") != "image":
                raise field_error("attack.kind", f"'backdoor' stamps a pixel trigger; dataset "
                                                 f"{config.data.dataset!r} has no images")
            if self.size > min(shape):
                raise field_error("attack.trigger", f"{self.size} pixels does not fit the "
                                                    f"{shape[0]}x{shape[1]} images of "
                                                    f"{config.data.dataset!r}")
        self.map = label_map(classes, a.target, device)
        self.device = device

    def client(self, c: int, indices: np.ndarray) -> "ClientPoison | None":
        if c not in self.ids:
            return None
        chosen = None
        if self.kind == "backdoor":
            order = torch.randperm(len(indices), generator=torch_generator(self.seed, "backdoor", c))
            m = min(len(indices), max(1, math.ceil(self.fraction * len(indices))))
            chosen = torch.sort(torch.as_tensor(indices, dtype=torch.int64)[order[:m]]).values
            chosen = chosen.to(self.device)
        return ClientPoison(self, chosen)


class ClientPoison:
    """One malicious identity's poison: ``apply(batch, x, y)`` on a batch's dataset ids,
    images and labels. ``x`` is the batch's own gathered copy (an index into the shared
    tensors makes one), so the trigger is stamped into it in place."""

    def __init__(self, poisoning: Poisoning, chosen: torch.Tensor | None):
        self.map, self.size, self.target = poisoning.map, poisoning.size, poisoning.target
        self.chosen = chosen

    def apply(self, batch: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        if self.chosen is None:   # label flipping
            return x, self.map[y]
        marked = torch.isin(batch.to(self.chosen.device), self.chosen)
        corner = x[:, :, x.shape[2] - self.size:, x.shape[3] - self.size:]
        corner[marked] = 255
        return x, torch.where(marked, torch.full_like(y, self.target), y)


class AttackSuccess:
    """The evaluator stage of a data attack: /rounds ``attack_success`` (module docstring),
    the test chunks sharded over the workers as the global test's, counts added in chunk
    order."""

    table = None
    round_fields = ["attack_success"]
    table_fields: list[str] = []

    def __init__(self, config):
        self.kind, self.target, self.size = config.attack.kind, config.attack.target, \
            config.attack.trigger

    @torch.no_grad()
    def evaluate(self, exp, timers, round_: int):
        """On the model the global test loaded into the workers (it runs first)."""
        t0 = time.perf_counter()
        comm, bs, data = exp.comm, exp.eval_batch, exp.data
        rows = np.zeros((0, 3))
        if comm.is_worker:
            module = exp.flat.module
            module.eval()
            mapping = label_map(exp.num_classes, self.target, data.test_y.device)
            ids = chunks_of(len(data.test_y), bs, comm.worker_index, comm.num_workers)
            counts = []
            for j in ids:
                x = data.test_x[j * bs:(j + 1) * bs]
                y = data.test_y[j * bs:(j + 1) * bs]
                want = mapping[y]
                moved = want != y
                x = x[moved].clone()
                if self.kind == "backdoor":
                    stamp(x, self.size)
                hit = module(data.prepare(x, None)).argmax(1) == want[moved] if len(x) \
                    else torch.zeros(0, dtype=torch.bool, device=y.device)
                counts.append(torch.stack([hit.sum(), moved.sum()]).double())
            rows = np.zeros((len(ids), 3))
            rows[:, 0] = ids
            if counts:
                rows[:, 1:] = torch.stack(counts).cpu().numpy()   # host sync: once an evaluation
        parts = comm.gatherv(rows.reshape(-1))
        timers.eval += time.perf_counter() - t0
        if not comm.is_server:
            return {}, None
        table = np.concatenate(parts).reshape(-1, 3)
        table = table[np.argsort(table[:, 0], kind="stable")]
        hits, moved = table[:, 1].sum(), table[:, 2].sum()
        return {"attack_success": float(hits / moved) if moved else math.nan}, None
