"""Orchestra: online/target networks trained to agree on globally consistent clusters.

Lubana, Tang, Kawsar, Dick & Mathur, "Orchestra: Unsupervised Federated Learning via
Globally Consistent Clustering", ICML 2022, https://arxiv.org/abs/2205.11506 (code:
akhilmathurs/orchestra, models.py ``orchestra``, client.py ``ssl_train``, myfedavg.py).

Model: online encoder f, projector g (z = g(f(x))) and a rotation head r (Linear(p, 4), the
"degeneracy" layer); target xi = encoder + projector (the flat prefix of the online vector,
as in fedmpi.algorithms.byol). The global centroids C (G x p, unit rows) are not trained by
the clients: they ride along as a separate payload.

Client k, from x^t (online), xi (target), C:
- setup round (C not yet set, i.e. all zero): no training; the memory is filled with the
  target's l2-normalised projections of view 1 of the client's first ``memory_size``
  samples (the code's ``reset_memory``), then local clustering; Delta_k = 0.
- otherwise E epochs; at each step, first xi <- tau xi + (1 - tau) theta (the code updates
  the target inside ``forward``, before the target's forward pass, i.e. from the online
  weights *before* the step), then with t1 = normalize(g_xi(f_xi(x1))),
  z2 = normalize(g(f(x2))), r3 = r(g(f(rot_k(x1)))), k ~ U{0..3} per sample,

      L = w_c * mean_i [ -sum_j softmax(t1_i C^T / T)_j log softmax(z2_i C^T / T)_j ]
          + w_r * CE(r3, k),

  and t1 is pushed into a FIFO memory of ``memory_size`` rows (the code's
  ``update_memory``); SGD on theta (f, g, r).
- local clustering (after training, the code's ``local_clustering``): ``local_clusters``
  = m centroids by K-means on the memory, ``local_iters`` iterations of equal-size
  assignments (Sinkhorn-Knopp, lambda = 25, 10 iterations, argmax) and centroid =
  normalize(mean of its rows), an empty cluster reseeded by a random row; initial
  centroids m distinct random rows.
Upload: Delta_k = theta_K - x^t (d), the m local centroids (m p, ``gather``) and, with
``target = "global"``, xi_K - xi_0 (|xi|).

Server: x^{t+1} = x^t + eta_g sum_k n_k Delta_k / sum_k n_k (and so for xi with
``target = "global"``); then the global clustering of the K m uploaded local centroids
Z into G = ``global_clusters`` centroids:
- ``global_clustering = "sgd"`` (the code's ``global_clustering``, the default): from the
  previous C (the first time U(-1/sqrt(p), 1/sqrt(p)), nn.Linear's initialisation, seeded
  from (seed, round)), ``global_iters`` = 500 steps of SGD (lr 0.01, momentum 0.9, weight
  decay 1e-4, the buffer new each round) on -mean_i cos(SK_i, softmax(Z_i C^T / T)),
  SK = Sinkhorn-Knopp(Z C^T) (lambda 25, at most 100 iterations), rows of C renormalised
  after every step.
- ``global_clustering = "kmeans"`` (fedmpi's option, no reference): the clients' equal-size
  K-means run on Z at the server, initialised from G distinct uploads drawn with (seed,
  round); needs K m >= G (refused in the round where it is not so).

Messages: down d + G p (+ |xi| with target = global), up d + m p (+ |xi|).
Server state: x, centroids (G p; zero until the setup round), target (global).
Client state: with ``target = "local"`` FedBYOL's (target |xi|, seen 1); none otherwise.

Paper-vs-code choices, each the code's unless said:
- The target's assignments are a plain softmax at T = 0.1 (no Sinkhorn in the local loss;
  the equal-size constraint is in the two clusterings only), one direction (target on x1,
  online on x2). log softmax is computed as such (the code: log(softmax)). So the local
  loss has no batch-size requirement.
- ``target = "global"`` (default): the code's ``stateful_client = False`` ("not used with
  Orchestra" says its config): the target is part of the model, sent down and averaged.
  ``target = "local"`` keeps it on the client as FedBYOL does (the code's stateful client).
- The rotation view is view 1 rotated (the code rotates a third augmentation; fedmpi's
  views are two). fedmpi's heads use LayerNorm (or nothing) where the code's projector has
  BatchNorm (a 512-512-512 MLP: ``proj_hidden`` default 512).
- Memory: per round (the code's simulated clients are rebuilt every round, so only the
  current round's projections reach the clustering); a client that saw fewer than
  ``memory_size`` projections clusters those it saw, and one that saw fewer than m (a
  client of a few samples, which the code's splits never make) uploads each of them as
  a centroid, cycled to m rows (fedmpi's choice: the run goes on).
- The setup round is one of the configured rounds (the code adds one: rounds = its
  num_rounds + 1). FedAvg weights n_k (the code: batches per epoch).
- Randomness: K-means initial rows and reseeds from (seed, round, client) (client) or
  (seed, round) (server); rotation angles from (seed, round, client) on the device.
- The local centroids travel as a gathered vector (``gather_sizes``) that the results
  file does not keep (``recorded_gather``): m p values a client (8192 at the defaults)
  would be as many /clients columns.
- Not refused at config time (the protocol's checks see neither clients.per_round nor
  the clients' sizes): with ``global_clustering = "kmeans"`` K m < G is refused in the
  round, naming the parameter.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models.ssl import SSLNet
from . import local_sgd
from .base import Algorithm, Upload, register
from .byol import target_model
from .clustering import equal_size_kmeans, generator_for, sgd_clustering
from .fedsimclr import SSLParams
from .mixins import SelfSupervised
from .params import param, param_error
from .ssl_losses import ema_update

TARGETS = ("global", "local")
GLOBAL_CLUSTERINGS = ("sgd", "kmeans")
ROTATIONS = 4


@dataclass(frozen=True)
class OrchestraParams(SSLParams):
    proj_hidden: int = param(512, ">= 1", "projector hidden width (the code's: 512)")
    global_clusters: int = param(128, ">= 1", "G, global centroids (the code's CIFAR default 128)")
    local_clusters: int = param(16, ">= 1", "m, local centroids each client uploads (the code: 16)")
    memory_size: int = param(128, ">= 1",
                             "target projections a client keeps for local clustering (the code: 128)")
    temperature: float = param(0.1, "(0, inf)", "T of both softmaxes over the centroids (the code: 0.1)")
    tau_ema: float = param(0.996, "[0, 1]",
                           "target EMA rate, xi <- tau xi + (1 - tau) theta before every step "
                           "(the code: 0.996)")
    cluster_weight: float = param(1.0, ">= 0", "weight of the clustering loss (the code: 1)")
    rotation_weight: float = param(1.0, ">= 0",
                                   "weight of the rotation-prediction (degeneracy) loss; 0 drops "
                                   "the rotation head (the code: 1)")
    target: str = param("global", TARGETS,
                        "global (the target is averaged and sent down, the code's default) | "
                        "local (kept on the client, FedBYOL's way)")
    local_iters: int = param(5, ">= 1", "K-means iterations of the local clustering (the code: 5)")
    global_clustering: str = param("sgd", GLOBAL_CLUSTERINGS,
                                   "sgd (the code's Sinkhorn-target SGD on C) | kmeans "
                                   "(equal-size K-means on the server, fedmpi's option)")
    global_iters: int = param(500, ">= 1",
                              "server clustering steps: SGD steps (sgd, the code: 500) or K-means "
                              "iterations (kmeans)")
    cluster_lr: float = param(0.01, "(0, inf)", "server clustering SGD lr (the code: 0.01)")
    cluster_momentum: float = param(0.9, "[0, 1)", "server clustering SGD momentum (the code: 0.9)")
    cluster_weight_decay: float = param(1e-4, ">= 0",
                                        "server clustering SGD weight decay (the code: 1e-4)")
    sinkhorn_lambda: float = param(25.0, "(0, inf)",
                                   "Sinkhorn-Knopp sharpness: softmax(lambda * scores) (the code: 25)")
    local_sinkhorn_iters: int = param(10, ">= 1",
                                      "Sinkhorn-Knopp iterations (at most) in local clustering "
                                      "(the code: 10)")
    global_sinkhorn_iters: int = param(100, ">= 1",
                                       "Sinkhorn-Knopp iterations (at most) in global clustering "
                                       "(the code: 100)")

    def __post_init__(self):
        super().__post_init__()
        if self.memory_size < self.local_clusters:
            raise param_error("memory_size", f"must be >= local_clusters = {self.local_clusters} "
                              f"(m distinct rows start the local K-means), got {self.memory_size}")



def rotated(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each image x_i [C, H, W] (H = W) rotated by k_i quarter turns."""
    turns = torch.stack([torch.rot90(x, r, dims=(2, 3)) for r in range(ROTATIONS)])
    return turns[k, torch.arange(x.shape[0], device=x.device)]


class Memory:
    """The last ``size`` rows pushed (a FIFO of target projections), without host syncs."""

    def __init__(self, size: int):
        self.size, self.count, self.chunks = size, 0, deque()

    def push(self, rows: torch.Tensor) -> None:
        self.chunks.append(rows.detach())
        self.count += rows.shape[0]
        while self.count - self.chunks[0].shape[0] >= self.size:
            self.count -= self.chunks.popleft().shape[0]

    def rows(self) -> torch.Tensor:
        return torch.cat(list(self.chunks))[-self.size:]


class OrchestraNet(SSLNet):
    """SSLNet + the rotation head, registered after the projector so that the target
    (encoder + projector) is the flat prefix; the target leaves the head out."""

    def target_copy(self) -> SSLNet:
        rotation = self._modules.pop("rotation", None)
        try:
            return super().target_copy()
        finally:
            if rotation is not None:
                self.rotation = rotation


@register
class Orchestra(SelfSupervised, Algorithm):
    name = "orchestra"
    paper = "Lubana et al. 2022, arXiv:2205.11506"
    Params = OrchestraParams

    def __init__(self, params=None):
        super().__init__(params)
        self._target = None   # (the worker's flat model, its target network): a cache only

    # ---- model ----
    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        net = super().build_model(build, name, in_channels, num_classes, image_size, options)
        net.__class__ = OrchestraNet   # same module, a target_copy that drops the head
        if self.params.rotation_weight > 0:
            net.rotation = nn.Linear(self.params.proj_dim, ROTATIONS)
        return net

    def head_size(self) -> int:
        p = self.params.proj_dim
        return ROTATIONS * p + ROTATIONS if self.params.rotation_weight > 0 else 0

    def target_size(self, d: int) -> int:
        return d - self.head_size()

    def _sizes(self, d: int) -> tuple[int, int, int]:
        """(|xi| if it travels else 0, G p, m p)."""
        p = self.params
        travels = self.target_size(d) if p.target == "global" else 0
        return travels, p.global_clusters * p.proj_dim, p.local_clusters * p.proj_dim

    # ---- declarations ----
    def traffic(self, d, phase):
        t, down, up = self._sizes(d)
        return d + t + down, d + t + up

    def client_state_sizes(self, d):
        return {"target": self.target_size(d), "seen": 1} if self.params.target == "local" else {}

    def gather_sizes(self, d, phase=None):
        return {"centroids": self._sizes(d)[2]}

    def recorded_gather(self, d):
        return {}

    def contribution_sizes(self, d, phase=None):
        sizes = super().contribution_sizes(d, phase)
        return {**sizes, "target": self.target_size(d)} if self.params.target == "global" else sizes

    # ---- server ----
    def init_server_state(self, x):
        p = self.params
        state = {"x": x.clone(),
                 "centroids": torch.zeros(p.global_clusters * p.proj_dim, dtype=x.dtype,
                                          device=x.device)}
        if p.target == "global":
            state["target"] = x[:self.target_size(len(x))].clone()
        return state

    def payload(self, state, ctx):
        out = {"x": state["x"], "centroids": state["centroids"]}
        if self.params.target == "global":
            out["target"] = state["target"]
        return out

    def server_update(self, state, sums, gathered, ctx):
        super().server_update(state, sums, gathered, ctx)
        if self.params.target == "global":
            weight = float(sums["weight"])  # host sync: server, once per round
            state["target"].add_(sums["target"], alpha=ctx.global_lr / weight)
        p = self.params
        c = state["centroids"]
        z = torch.as_tensor(np.asarray(gathered["centroids"]), dtype=c.dtype,
                            device=c.device).reshape(-1, p.proj_dim)
        if z.shape[0] == 0:
            return
        state["centroids"].copy_(self.global_clustering(z, c.view(p.global_clusters, p.proj_dim),
                                                        ctx).reshape(-1))

    def global_clustering(self, z: torch.Tensor, centroids: torch.Tensor, ctx) -> torch.Tensor:
        """New G x p centroids from the uploaded local centroids ``z`` [K m, p]."""
        p = self.params
        g = generator_for(ctx.seed, "orchestra-server", ctx.round)
        if p.global_clustering == "kmeans":
            if z.shape[0] < p.global_clusters:
                raise param_error("global_clusters", f"{p.global_clusters} global clusters need at "
                                  f"least as many local centroids; round {ctx.round} uploaded "
                                  f"{z.shape[0]} ({z.shape[0] // p.local_clusters} clients x "
                                  f"{p.local_clusters})")
            return equal_size_kmeans(z, p.global_clusters, p.global_iters, g,
                                     p.sinkhorn_lambda, p.global_sinkhorn_iters)
        if not bool(centroids.any()):   # host sync: server, once per round (nn.Linear(p, G)'s seeded init)
            bound = 1.0 / math.sqrt(p.proj_dim)
            centroids = (torch.rand(centroids.shape, generator=g, dtype=centroids.dtype)
                         * 2 - 1).mul_(bound).to(centroids.device)
        return sgd_clustering(z, centroids, p.temperature, p.global_iters, p.cluster_lr,
                              p.cluster_momentum, p.cluster_weight_decay, p.sinkhorn_lambda,
                              p.global_sinkhorn_iters)

    # ---- client ----
    def local_update(self, task, payload, client_state, ctx):
        p = self.params
        x = payload["x"]
        t = self.target_size(len(x))
        centroids = payload["centroids"].view(p.global_clusters, p.proj_dim)
        setup = not bool(centroids.any())   # host sync: once per client
        if p.target == "global":
            target_start = payload["target"]
        else:
            seen = bool(client_state["seen"].item())   # host sync: once per client
            target_start = client_state["target"] if seen else x[:t]
        task.model.load(x)
        target = self._target_of(task.model)
        target.load(target_start)
        target.module.train(True)   # same mode as the online network (no running statistics)
        memory = Memory(p.memory_size)
        if setup:
            loss, steps = self.fill(task, ctx, target, memory)
        else:
            loss, steps = self.train(task, ctx, target, centroids, memory)
        local = self.local_clustering(memory, task, ctx)
        w = task.model.params
        extras = {"centroids": local.reshape(-1)}
        state = None
        if p.target == "global":
            extras["target"] = target.params - target_start
        else:
            state = {"target": target.params.clone(), "seen": torch.ones(1, device=w.device)}
        return Upload(delta=w - x, num_samples=task.data.num_samples, loss=loss, steps=steps,
                      extras=extras, state=state)

    @torch.no_grad()
    def fill(self, task, ctx, target, memory: Memory) -> tuple[float, int]:
        """The setup round: the target's projections of view 1 of the first memory_size
        samples (one pass at most), no training."""
        for (v1, _), _ in task.data.view_batches(1, ctx.batch_size):
            memory.push(F.normalize(target.module.project(v1), dim=1))
            if memory.count >= memory.size:
                break
        return 0.0, 0

    def train(self, task, ctx, target, centroids, memory: Memory) -> tuple[float, int]:
        """E epochs of the clustering + rotation loss, the target EMA before every step."""
        p = self.params
        rotate = p.rotation_weight > 0
        angles = generator_for(ctx.seed, "orchestra-rotation", ctx.round, task.client,
                               device=task.device) if rotate else None
        cT = centroids.T

        def loss_fn(module, views, y):
            x1, x2 = views
            b = x1.shape[0]
            with torch.no_grad():
                t1 = F.normalize(target.module.project(x1), dim=1)
                memory.push(t1.float())
                soft = F.softmax(t1 @ cT / p.temperature, dim=1)
            parts = [x2]
            if rotate:
                k = torch.randint(ROTATIONS, (b,), generator=angles, device=x1.device)
                parts.append(rotated(x1, k))
            out = module.project(torch.cat(parts) if rotate else x2)
            z2 = F.normalize(out[:b], dim=1)
            loss = -(soft * F.log_softmax(z2 @ cT / p.temperature, dim=1)).sum(dim=1).mean()
            loss = p.cluster_weight * loss
            if rotate:
                loss = loss + p.rotation_weight * F.cross_entropy(module.rotation(out[b:]), k)
            return loss

        batches = ema_before_each_step(task.data.view_batches(ctx.local_epochs, ctx.batch_size),
                                       target.params, task.model.params, p.tau_ema)
        return local_sgd.train(task, ctx, loss_fn=loss_fn, batches=batches)

    def local_clustering(self, memory: Memory, task, ctx) -> torch.Tensor:
        p = self.params
        if memory.count < p.local_clusters:
            # fewer projections than clusters: each is its own centroid, cycled to m rows
            # (a client of a few samples under strong label skew; the code never meets one)
            rows = F.normalize(memory.rows(), dim=1)
            return rows[torch.arange(p.local_clusters, device=rows.device) % memory.count]
        g = generator_for(ctx.seed, "orchestra-local", ctx.round, task.client)
        return equal_size_kmeans(memory.rows(), p.local_clusters, p.local_iters, g,
                                 p.sinkhorn_lambda, p.local_sinkhorn_iters)

    def contribution(self, upload):
        out = super().contribution(upload)
        if self.params.target == "global":
            out["target"] = upload.extras["target"] * float(upload.num_samples)
        return out

    def gather(self, upload):
        return {"centroids": upload.extras["centroids"]}

    def _target_of(self, flat):
        """The worker's target network, built once per worker model."""
        if self._target is None or self._target[0] is not flat:
            target = target_model(flat)
            if target.size != self.target_size(flat.size):
                raise ValueError(f"target network has {target.size} values, expected "
                                 f"{self.target_size(flat.size)} (d - rotation head)")
            self._target = (flat, target)
        return self._target[1]


def ema_before_each_step(batches, target: torch.Tensor, online: torch.Tensor, tau: float):
    """Yield ``batches``, first applying xi <- tau xi + (1 - tau) theta[:len(xi)] each time
    (the code's ``update_target`` at the top of ``forward``: from the weights before the
    step)."""
    n = target.numel()
    for batch in batches:
        ema_update(target, online[:n], tau)
        yield batch
