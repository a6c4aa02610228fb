"""Malicious clients (``[attack]``): a keyed set of the population whose uploads are
poisoned, a client stage that runs first on the worker that trained the client (before a
clip or a codec: what the attacker sends is what the pipeline then treats as its upload).
The colluding attacks (``alie``, ``ipm``, ``min_max``, ``min_sum``) act where the robust
rule reads the updates (fedmpi.runtime.omniscient), the data attacks (``label_flip``,
``backdoor``) on the malicious clients' batches (fedmpi.runtime.poison); for those this
stage only marks the attackers in /clients (``malicious``, 1 or 0).

Model poisoning, on the client's update Delta (what it computed honestly):

- ``sign_flip``: -scale Delta (scale 1: the reversed update);
- ``scale``: scale Delta (model replacement's boost, Bagdasaryan et al. 2020, with
  scale = n / eta_g);
- ``gaussian``: N(0, std^2) per coordinate, from the stream keyed by (seed, "attack",
  round, client), so the same on any rank.

The malicious set is round(fraction N) identities (at least one) drawn from the stream
keyed by (seed, "attack"); it is recorded in /partition/malicious. A malicious client is
malicious whenever it is sampled.
"""

from __future__ import annotations

import numpy as np
import torch

from .rng import numpy_rng, torch_generator
from .stages import ClientStage

MODEL = ("sign_flip", "scale", "gaussian")


def malicious(config) -> np.ndarray:
    """The attacking identities, ascending (empty without an attack)."""
    a, n = config.attack, config.clients.num
    if a.kind == "none":
        return np.zeros(0, dtype=np.int64)
    count = min(n, max(1, round(a.fraction * n)))
    rng = numpy_rng(config.seed, "attack")
    return np.sort(rng.choice(n, count, replace=False)).astype(np.int64)


class ModelPoisoning(ClientStage):
    """The ``[attack]`` stage: a malicious client's upload poisoned (module docstring), and
    every participant marked malicious or not in /clients."""

    client_fields = ["malicious"]

    def __init__(self, config):
        self.kind, self.scale, self.std = config.attack.kind, config.attack.scale, config.attack.std
        self.seed = config.seed
        self.marked = malicious(config)
        self.ids = set(self.marked.tolist())

    def columns(self, clients):
        return {"malicious": np.isin(np.asarray(clients, dtype=np.int64), self.marked)
                .astype(np.int64)}

    def upload(self, upload, state, key):
        t, c, _ = key
        if c not in self.ids or self.kind not in MODEL:
            return upload, {}
        delta = upload.delta
        if self.kind == "sign_flip":
            upload.delta = delta * -self.scale
        elif self.kind == "scale":
            upload.delta = delta * self.scale
        else:
            g = torch_generator(self.seed, "attack", t, c)
            upload.delta = (torch.randn(delta.numel(), generator=g) * self.std).to(delta)
        return upload, {}


def attack_stages(config) -> list[ClientStage]:
    return [ModelPoisoning(config)] if config.attack.kind != "none" else []
