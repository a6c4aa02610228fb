"""Differential privacy as stages of the update pipeline (accounting in fedmpi.privacy).

User-level central DP, DP-FedAvg (McMahan et al., "Learning Differentially Private
Recurrent Language Models", ICLR 2018), ``privacy.mechanism = "central"``:

- ``ClipUpdate``, a client stage, first of all (before any codec): the client's update
  Delta_i scaled to L2 norm at most C (``privacy.clip``), and its contribution made
  (Delta_i, weight 1). The method's own weight n_i would make the sensitivity grow with
  the client's data: the clip bounds Delta_i, not n_i Delta_i. With adaptive clipping
  (``privacy.clip_quantile``; Andrew et al. 2021) C is the round's, sent down by the
  server, and each client adds whether it was clipped to a summed count.
- ``Canaries`` (``privacy.audit_canaries = m``), a server stage before the noise: the
  one-run audit's m canary clients (fedmpi.audit), each included with probability 1/2,
  present in a round with the clients' probability q, each sending +-C on a coordinate
  of its own; after the last round they are scored by the model's movement there and
  the audit's lower bound on epsilon is reported.
- ``CentralNoise``, a server stage, after the reduce and before the server update: the
  sum gets N(0, sigma^2 C^2) per coordinate, drawn once, on the server, from the stream
  keyed by (seed, "dp-noise", round, phase) (never in the workers' partial sums, which
  would add it once a worker and depend on the layout), and the denominator becomes the
  fixed S = ``clients.per_round`` (the expected count q N under Bernoulli sampling, the
  count itself under uniform sampling), never the realised count. FedAvg's update then
  gives x <- x + eta_g (sum_i clip(Delta_i) + noise) / S. After the update it reports
  ``epsilon`` for the rounds so far; with adaptive clipping it noises the count and
  moves C.

Local DP (``"local"``): ``LocalNoise``, a client stage first of all, clips and noises each
update on its worker; ``Accounting`` reports a client's epsilon. Sample-level DP-SGD
(``"sample"``): every local step's gradient (fedmpi.runtime.dp_sgd, through
``private_steps``), and ``SampleAccounting`` for the smallest client.

What the accounting assumes is refused where a config breaks it (``refuse``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import algorithms, audit, privacy
from ..algorithms.base import fedavg_server_side
from ..config.coerce import field_error
from .dp_sgd import PrivateSteps
from .rng import torch_generator
from .stages import ClientStage


class ClipUpdate(ClientStage):
    """Delta_i <- Delta_i min(1, C / ||Delta_i||); the contribution (Delta_i, 1). With
    adaptive clipping (``adaptive``) C is the round's, which the server sends down
    (``receive``), and the contribution adds the centred bit b_i - 1/2, b_i = [||Delta_i||
    <= C], to the summed ``dp_below``: one value down and one up a participation."""

    def __init__(self, clip: float, adaptive: bool = False):
        self.clip, self.adaptive = clip, adaptive
        self.below = None   # the last upload's b_i, which its contribute adds

    def receive(self, values):
        if "dp_clip" in values:
            self.clip = float(values["dp_clip"])

    def traffic(self, p):
        return (1, 1) if self.adaptive else (0, 0)

    def sums(self, p, d):
        return {"dp_below": 1} if self.adaptive else {}

    def upload(self, upload, state, key):
        norm = torch.linalg.vector_norm(upload.delta)
        self.below = norm <= self.clip
        upload.delta = upload.delta * torch.clamp(self.clip / norm, max=1.0)   # 0/0: never, C > 0
        return upload, {}

    def contribute(self, contribution, upload, meta):
        one = torch.ones(1, dtype=upload.delta.dtype, device=upload.delta.device)
        out = {**contribution, "delta": upload.delta, "weight": one}
        if self.adaptive:
            out["dp_below"] = one * (self.below.to(one.dtype) - 0.5)
        return out


class ServerStage:
    """On the server: ``download`` adds values to the round's payload for the client
    stages; after the reduce ``before`` the server update may change the sums (which
    still hold the client stages' extra sums); ``after`` it gives round diagnostics
    (``round_fields``). State a stage keeps across rounds lives in the server state under
    a name of its own (checkpointed with it)."""
    round_fields: list[str] = []

    def download(self, state) -> dict:
        return {}

    def before(self, state, sums: dict, gathered: dict, ctx, p: int) -> None:
        pass

    def after(self, state, sums: dict, gathered: dict, ctx, p: int) -> dict:
        return {}

    def describe(self) -> dict:
        """Root attributes of the results file."""
        return {}


class Accounting(ServerStage):
    """``epsilon`` after every round (fedmpi.privacy; local DP: a client's that took part
    in every round so far) and the mechanism's root attributes."""
    round_fields = ["epsilon"]

    def __init__(self, config):
        self.config = config

    def after(self, state, sums, gathered, ctx, p):
        return {"epsilon": privacy.epsilon(self.config, ctx.round + 1)}

    def describe(self):
        return privacy.describe(self.config)


class LocalNoise(ClientStage):
    """Local DP, first of the client stages: the client's update clipped to norm C (L2
    for Gaussian noise, L1 for Laplace) and noised on its worker before anything else sees
    it: N(0, sigma^2 C^2) per coordinate, or Laplace of scale sigma C, from the stream
    keyed by (seed, round, client, phase), so the same on any layout. What the server does
    with noised updates (the method's weights, a codec, the mean) is post-processing."""

    def __init__(self, config):
        p = config.privacy
        self.seed, self.clip, self.laplace = config.seed, float(p.clip), p.local_noise == "laplace"
        self.scale = float(p.noise_multiplier) * self.clip

    def upload(self, upload, state, key):
        delta = upload.delta
        norm = torch.linalg.vector_norm(delta, ord=1 if self.laplace else 2)
        delta = delta * torch.clamp(self.clip / norm, max=1.0)
        if self.scale:
            g = torch_generator(self.seed, "dp-local", *key)
            if self.laplace:   # Laplace(1) = E_1 - E_2, E = -log(1 - U) exponential
                u = torch.rand(2, delta.numel(), generator=g, dtype=torch.float64)
                noise = torch.log1p(-u[1]) - torch.log1p(-u[0])
            else:
                noise = torch.randn(delta.numel(), generator=g)
            delta = delta + (noise * self.scale).to(device=delta.device, dtype=delta.dtype)
        upload.delta = delta
        return upload, {}


CLIP_RANGE = (1e-30, 1e30)   # adaptive clipping's C stays in it (float32's range)


class CentralNoise(Accounting):
    """N(0, sigma^2 C^2) on the summed updates, the fixed denominator S, epsilon after.
    With adaptive clipping (Andrew et al. 2021) C is the round's C_t, kept in the server
    state (``dp_clip``, float32: the value the clients receive), the updates' noise
    multiplier is sigma_Delta, and the summed centred bits get N(0, sigma_b^2) from their
    own keyed stream; the unclipped fraction b = (their sum) / S + 1/2 moves the clip:
    C_(t+1) = C_t exp(-eta_C (b - gamma))."""

    def __init__(self, config, d: int):
        super().__init__(config)
        self.d = d
        p = config.privacy
        self.adaptive = bool(p.clip_quantile)
        self.multiplier = privacy.update_noise_multiplier(config)
        self.count_std = privacy.count_std(config) if p.noise_multiplier else 0.0
        self.denominator = float(config.clients.per_round)
        self.round_fields = ["epsilon"] + (["dp_clip", "dp_unclipped"] if self.adaptive else [])
        self.row = {}

    def clip(self, state) -> float:
        """C_t: the config's, or adaptive clipping's current one."""
        if not self.adaptive:
            return float(self.config.privacy.clip)
        if "dp_clip" not in state:
            state["dp_clip"] = torch.tensor([self.config.privacy.clip], dtype=torch.float32)
        return float(state["dp_clip"])

    def download(self, state):
        if not self.adaptive:
            return {}
        self.clip(state)   # C_0 in the state before the first round
        return {"dp_clip": state["dp_clip"]}

    def before(self, state, sums, gathered, ctx, p):
        clip = self.clip(state)
        std = self.multiplier * clip
        if std:
            g = torch_generator(self.config.seed, "dp-noise", ctx.round, p)
            sums["delta"] = sums["delta"] + torch.randn(self.d, generator=g) * std
        sums["weight"] = torch.tensor([self.denominator], dtype=sums["delta"].dtype)
        if self.adaptive:
            below = float(sums["dp_below"].double().sum())
            if self.count_std:
                g = torch_generator(self.config.seed, "dp-count-noise", ctx.round, p)
                below += float(torch.randn(1, generator=g, dtype=torch.float64)) * self.count_std
            unclipped = below / self.denominator + 0.5
            q = self.config.privacy
            # the fraction read as one (post-processing: a count's noise can push it past
            # [0, 1]), and C kept where float32 holds it: the exponent is at most eta_C
            step = math.exp(-q.clip_lr * (min(max(unclipped, 0.0), 1.0) - q.clip_quantile))
            state["dp_clip"] = torch.tensor([min(max(clip * step, CLIP_RANGE[0]), CLIP_RANGE[1])],
                                            dtype=torch.float32)
            self.row = {"dp_clip": clip, "dp_unclipped": unclipped}

    def after(self, state, sums, gathered, ctx, p):
        return {**super().after(state, sums, gathered, ctx, p), **self.row}


class Canaries(ServerStage):
    """The one-run audit's canaries (Steinke, Nasr and Jagielski 2023): simulated clients
    of the population, on the server, adding their updates to the round's sum before the
    noise (so the whole mechanism, noise and fixed denominator, acts on them as on a
    client). Canary j's update is a Dirac update of norm C (the round's), +-C on its own
    coordinate k_j (the paper's white-box canaries: distinct coordinates, so canaries
    never interfere, and adding or scoring one costs O(1)). They send and receive nothing: the ledger
    counts the real clients only. Membership, presence, coordinates and signs come from
    keyed streams, so a resume and any rank count give the same canaries; x_0 is the
    initial model, which every start builds the same. With private layers the sums hold
    the d shared coordinates only (what travels): the canaries are among them, and
    ``shared`` takes the same coordinates of a full model (the global model's private
    part is not released)."""
    round_fields = ["audit_epsilon", "audit_guesses", "audit_correct"]

    def __init__(self, config, d: int, x0: torch.Tensor, shared=None):
        self.config, self.m = config, config.privacy.audit_canaries
        if self.m > d:
            raise field_error("privacy.audit_canaries", f"each canary has a coordinate of its "
                                                        f"own; at most the model's {d} "
                                                        f"{'shared ' if shared else ''}"
                                                        f"parameters, got {self.m}")
        self.shared = shared or (lambda v: v)
        self.x0 = self.shared(x0.detach()).to("cpu", torch.float64, copy=True)
        self.q = privacy.sampling_rate(config)
        seed = config.seed
        draw = torch.rand(self.m, generator=torch_generator(seed, "dp-audit-member"),
                          dtype=torch.float64)
        self.included = (draw < 0.5).numpy()
        self.coordinate = torch.randperm(d, generator=torch_generator(seed, "dp-audit-coordinate"))[:self.m]
        signs = torch.randint(0, 2, (self.m,), generator=torch_generator(seed, "dp-audit-sign"))
        self.sign = 2.0 * signs - 1

    def before(self, state, sums, gathered, ctx, p):
        g = torch_generator(self.config.seed, "dp-audit-present", ctx.round, p)
        present = (torch.rand(self.m, generator=g, dtype=torch.float64) < self.q).numpy()
        which = torch.from_numpy(np.flatnonzero(present & self.included))
        clip = float(state["dp_clip"]) if "dp_clip" in state else float(self.config.privacy.clip)
        delta = sums["delta"].clone()
        delta.index_put_((self.coordinate[which].to(delta.device),),
                         (clip * self.sign[which]).to(delta.dtype).to(delta.device), accumulate=True)
        sums["delta"] = delta
        if "dp_below" in sums:   # adaptive clipping: a canary is at the clip, so unclipped
            sums["dp_below"] = sums["dp_below"] + 0.5 * len(which)

    def after(self, state, sums, gathered, ctx, p):
        if ctx.round + 1 != self.config.rounds:
            return {}
        moved = self.shared(state["x"].detach()).cpu().double()[self.coordinate] - \
            self.x0[self.coordinate]
        scores = (moved * self.sign).numpy()
        return audit.audit(scores, self.included, privacy.delta_of(self.config))

    def describe(self):
        return {"privacy_audit_canaries": self.m,
                "privacy_audit": f"one run (Steinke, Nasr and Jagielski 2023): Dirac canary "
                                 f"updates +-C, score sign_j (x_T - x_0)[k_j], k/m in "
                                 f"{list(audit.GUESS_FRACTIONS)}, confidence {audit.CONFIDENCE}"}


def private_steps(config, key: tuple[int, int, int]):
    """Sample-level DP-SGD's steps for one client's task (fedmpi.runtime.dp_sgd), or None."""
    return PrivateSteps(config, key) if config.privacy.mechanism == "sample" else None


def smallest_client(sizes) -> int:
    """The smallest client that takes steps (clients without samples take none)."""
    return min((int(n) for n in sizes if n > 0), default=1)


def calibrate_sample(config, sizes) -> None:
    """Sample-level DP-SGD with ``privacy.target_epsilon``: the noise multiplier that keeps
    the smallest client within it, set in the config at start-up (on every rank alike, a
    pure function of the partition) before the file records it."""
    p = config.privacy
    if p.mechanism == "sample" and p.target_epsilon:
        p.noise_multiplier = privacy.sample_calibrate(config, smallest_client(sizes),
                                                      p.target_epsilon)


class SampleAccounting(Accounting):
    """Sample-level DP-SGD: epsilon of the smallest client (which spends the most) after
    every round, had it taken part in all of them."""

    def __init__(self, config, smallest: int):
        super().__init__(config)
        self.smallest = smallest

    def after(self, state, sums, gathered, ctx, p):
        return {"epsilon": privacy.sample_epsilon(self.config, self.smallest, ctx.round + 1)}

    def describe(self):
        rate, steps = privacy.sample_steps(self.config, self.smallest)
        return {**super().describe(), "privacy_sample_smallest_client": self.smallest,
                "privacy_sample_rate": rate, "privacy_sample_steps_per_round": steps}


def client_stages(config) -> list[ClientStage]:
    """The private client stages, first in the order (fedmpi.runtime.stages)."""
    p = config.privacy
    if p.mechanism == "local":
        return [LocalNoise(config)]
    return [ClipUpdate(p.clip, bool(p.clip_quantile))] if p.mechanism == "central" else []


def server_stages(config, d: int, x0: torch.Tensor, sizes=(), shared=None) -> list[ServerStage]:
    """The private server stages in order (``x0``: the initial model, for the audit;
    ``shared``: a full model's d shared coordinates, with private layers). Built on every
    rank, so a refusal is every rank's; only the server runs them."""
    if config.privacy.mechanism == "local":
        return [Accounting(config)]
    if config.privacy.mechanism == "sample":
        return [SampleAccounting(config, smallest_client(sizes))]
    if config.privacy.mechanism != "central":
        return []
    canaries = [Canaries(config, d, x0, shared)] if config.privacy.audit_canaries else []
    return canaries + [CentralNoise(config, d)]


# methods whose local update is local_sgd's with the default loss and gradient (their
# corrections and server sides use only what DP-SGD's steps produce: post-processing)
SAMPLE_ALGORITHMS = ("fedadam", "fedavg", "fedavgm", "feddyn", "fednova", "fedper", "fedprox",
                     "lg_fedavg", "scaffold")


def refuse(c) -> None:
    """Config time: what the accounting (a Gaussian mechanism on the sum of a Poisson or
    fixed-size sample of the population, every round) or the clip's bound would not hold
    for, as a one-line error naming the field."""
    mechanism = f"privacy.mechanism {c.privacy.mechanism!r}"
    name = c.algorithm.name
    if c.privacy.mechanism == "sample":
        if name not in SAMPLE_ALGORITHMS:
            raise field_error("privacy.mechanism", f"sample-level DP-SGD replaces the local "
                                                   f"steps' gradient; {name!r} computes its own "
                                                   f"(a loss or gradient of its own); use one of "
                                                   f"{', '.join(SAMPLE_ALGORITHMS)}")
        from .. import models   # deferred: the model registry is only needed here
        problem = models.group_problem(c.model.name, c.model.options)
        if problem:
            raise field_error("model.name", f"privacy.mechanism \"sample\" takes per-sample "
                                            f"gradients in the client-group form: {problem}")
        if c.model.options.get("norm") == "batch":
            raise field_error("model.norm", "privacy.mechanism \"sample\" clips each sample's "
                                            "gradient; BatchNorm mixes the samples of a batch "
                                            "(no per-sample gradient); use \"group\" or \"none\"")
        return   # the server's side is post-processing of private updates
    if not fedavg_server_side(algorithms.REGISTRY[name]):
        able = sorted(n for n, kind in algorithms.REGISTRY.items() if fedavg_server_side(kind))
        what = "user-level DP clips and noises the mean of the client deltas" \
            if c.privacy.mechanism == "central" else \
            "local DP clips and noises each client's delta, all it may upload"
        raise field_error("privacy.mechanism", f"{what}, FedAvg's server side; {name!r} has its "
                                               f"own; use one of {', '.join(able)}")
    if c.privacy.mechanism == "local":   # the rest is post-processing of noised uploads
        return
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
