"""User-level central differential privacy: DP-FedAvg (McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018) as two pipeline stages.

- ``ClipUpdate``, a client stage, first of all (before any codec): the client's update
  Delta_i scaled to L2 norm at most C (``privacy.clip``), and its contribution made
  (Delta_i, weight 1). The method's own weight n_i would make the sensitivity grow with
  the client's data: the clip bounds Delta_i, not n_i Delta_i.
- ``CentralNoise``, a server stage, after the reduce and before the server update: the
  sum gets N(0, sigma^2 C^2) per coordinate, drawn once, on the server, from the stream
  keyed by (seed, "dp-noise", round, phase) (never in the workers' partial sums, which
  would add it once a worker and depend on the layout), and the denominator becomes the
  fixed S = ``clients.per_round`` (the expected count q N under Bernoulli sampling, the
  count itself under uniform sampling), never the realised count. FedAvg's update then
  gives x <- x + eta_g (sum_i clip(Delta_i) + noise) / S. After the update it reports
  ``epsilon`` (fedmpi.privacy) for the rounds so far.

What the accounting assumes is refused where a config breaks it (``refuse``).
"""

from __future__ import annotations

import torch

from .. import algorithms, privacy
from ..algorithms.base import fedavg_server_side
from ..config.coerce import field_error
from .rng import torch_generator
from .stages import ClientStage


class ClipUpdate(ClientStage):
    """Delta_i <- Delta_i min(1, C / ||Delta_i||); the contribution (Delta_i, 1)."""

    def __init__(self, clip: float):
        self.clip = clip

    def upload(self, upload, state, key):
        norm = torch.linalg.vector_norm(upload.delta)
        upload.delta = upload.delta * torch.clamp(self.clip / norm, max=1.0)   # 0/0: never, C > 0
        return upload, {}

    def contribute(self, contribution, upload, meta):
        one = torch.ones(1, dtype=upload.delta.dtype, device=upload.delta.device)
        return {**contribution, "delta": upload.delta, "weight": one}


class ServerStage:
    """After the reduce, on the server: ``before`` the server update may change the sums;
    ``after`` it gives round diagnostics (``round_fields``)."""
    round_fields: list[str] = []

    def before(self, state, sums: dict, gathered: dict, ctx, p: int) -> None:
        pass

    def after(self, state, sums: dict, gathered: dict, ctx, p: int) -> dict:
        return {}

    def describe(self) -> dict:
        """Root attributes of the results file."""
        return {}


class CentralNoise(ServerStage):
    """N(0, sigma^2 C^2) on the summed updates, the fixed denominator S, epsilon after."""
    round_fields = ["epsilon"]

    def __init__(self, config, d: int):
        self.config, self.d = config, d
        p = config.privacy
        self.std = float(p.noise_multiplier) * float(p.clip)
        self.denominator = float(config.clients.per_round)

    def before(self, state, sums, gathered, ctx, p):
        if self.std:
            g = torch_generator(self.config.seed, "dp-noise", ctx.round, p)
            sums["delta"] = sums["delta"] + torch.randn(self.d, generator=g) * self.std
        sums["weight"] = torch.tensor([self.denominator], dtype=sums["delta"].dtype)

    def after(self, state, sums, gathered, ctx, p):
        return {"epsilon": privacy.epsilon(self.config, ctx.round + 1)}

    def describe(self):
        return privacy.describe(self.config)


def client_stages(config) -> list[ClientStage]:
    """The private client stages, first in the order (fedmpi.runtime.stages)."""
    return [ClipUpdate(config.privacy.clip)] if config.privacy.mechanism == "central" else []


def server_stages(config, d: int) -> list[ServerStage]:
    return [CentralNoise(config, d)] if config.privacy.mechanism == "central" else []


def refuse(c) -> None:
    """Config time: what the accounting (a Gaussian mechanism on the sum of a Poisson or
    fixed-size sample of the population, every round) or the clip's bound would not hold
    for, as a one-line error naming the field."""
    mechanism = f"privacy.mechanism {c.privacy.mechanism!r}"
    name = c.algorithm.name
    if not fedavg_server_side(algorithms.REGISTRY[name]):
        able = sorted(n for n, kind in algorithms.REGISTRY.items() if fedavg_server_side(kind))
        raise field_error("privacy.mechanism", f"user-level DP clips and noises the mean of "
                                               f"the client deltas, FedAvg's server side; "
                                               f"{name!r} has its own; use one of "
                                               f"{', '.join(able)}")
    z = c.compression
    if z.up != "none" or z.down != "none":
        raise field_error("compression.up" if z.up != "none" else "compression.down",
                          f"{mechanism}: a codec after the clip can grow an update's norm past "
                          f"C; set \"none\"")
    s = c.clients
    if s.sampling == "size":
        raise field_error("clients.sampling", f"{mechanism}: the accounting needs Poisson "
                                              f"(\"bernoulli\") or fixed-size (\"uniform\") "
                                              f"sampling, not sampling by size")
    if s.replace_prob:
        raise field_error("clients.replace_prob", f"{mechanism}: the accounting assumes a "
                                                  f"static population; set 0")
    if c.partition.params.get("min_size", 1) == 0:
        raise field_error("partition.min_size", f"{mechanism}: clients without samples can "
                                                f"empty a round, which then releases no noised "
                                                f"model; set it >= 1")
    if c.system_model.profiles != "off":
        raise field_error("system_model.profiles", f"{mechanism}: availability, deadlines and "
                                                   f"asynchronous steps change who is sampled, "
                                                   f"which the accounting does not model; set "
                                                   f"\"off\"")
    if s.sampling == "bernoulli":
        if s.empty_rounds == "skip":
            raise field_error("clients.empty_rounds", f"{mechanism}: an empty round would "
                                                      f"release no noised model; set \"redraw\"")
        # a redrawn empty draw conditions every round on a non-empty sample: allowed where
        # that event is too rare to matter next to delta (docs/privacy.md)
        empty = c.rounds * (1 - s.per_round / s.num) ** s.num
        delta = privacy.delta_of(c)
        if empty > delta / 1000:
            raise field_error("clients.per_round", f"{mechanism}: with q = {s.per_round}/{s.num} "
                                                   f"a Bernoulli draw is empty with chance "
                                                   f"{empty:.3g} over the run, more than delta/1000 "
                                                   f"= {delta / 1000:.3g}; sample more clients a "
                                                   f"round, or use \"uniform\" sampling")
