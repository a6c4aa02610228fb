"""L-DAWA: layer-wise divergence-aware weight aggregation over SimSiam, SimCLR or BYOL clients.

Rehman, Gao, de Gusmao, Alibeigi, Shen and Lane, "L-DAWA: Layer-wise Divergence Aware
Weight Aggregation in Federated Self-Supervised Visual Representation Learning", ICCV 2023,
https://arxiv.org/abs/2307.07393 (code: yasar-rehman/L-DAWA, ``L-DAWA-Agg.py`` and
``FL_Pretraining/main_CIFAR10_LDAWA.py``, function ``my_aggregate``).

Client k: the backbone's local update from x^t, unchanged (``backbone``: ``simsiam``, the
default, the method of FedU^2's L-DAWA baseline script, XeniaLLL/FedU2
``src/mains/train_LDAWA.py``; ``simclr``, the contrastive method of the L-DAWA paper's own
experiments; ``byol``, with the target kept on the client as in FedBYOL); it sends its
model theta_k = x^t + Delta_k, d values, as FedAvg's clients do.

Server, per layer l (a tensor of the flat layout, parameter or floating buffer: a weight
and its bias are two layers, as in the authors' loop over the state dict):

    delta_k^l = min(cos(theta_k^l, x^{t,l}), 1),
    x^{t+1,l} = sum_k w_k delta_k^l theta_k^l / sum_k w_k                (normalise = none)
              = sum_k w_k delta_k^l theta_k^l / sum_k w_k delta_k^l      (normalise = cosines)

with w_k = 1 (``weighting = "uniform"``: 1/K, sample counts unused, as in the authors' code
and FedU^2's) or n_k (``"samples"``, fedmpi's option). The default rule, ``none`` with
uniform weights, is the authors' released aggregation (``my_aggregate``): every layer of
every client is scaled by its cosine and the scaled models are averaged without
renormalising, so the aggregate also shrinks toward 0 by the mean cosine; the code clips a
cosine above 1 (rounding) to 1 and lets negative ones through, as here.
``normalise = "cosines"`` is the convex combination that FedU^2's re-implementation uses in
its SimSiam branch (``LDAWAServer`` passes cos_k / K to fedbox's ``model_average``, which
normalises; its SimCLR and BYOL branches, ``layer_aggregate``, do not); with it, clients
whose cosines agree per layer give FedAvg's model (or, uniform, the plain mean) and a layer
whose normaliser is 0 keeps x^l. ``granularity = "module"`` takes one cosine per top-level
module (encoder, projector, predictor), as FedU^2's code does (``calculate_ldawa_weights``
and ``layer_aggregate`` flatten each module whole); the default ``"layer"`` is the method's
own and the authors' code's. The cosine is undefined where ||theta_k^l|| or ||x^l|| is 0 (a
bias initialised to 0, LayerNorm's): fedmpi takes delta = 1 there, so that layer is
averaged as by FedAvg; the authors' code skips a zero client layer (which adds 0 either
way) and would divide by a zero global norm. A 0-d tensor keeps delta = 1, as in the code.
``warmup_rounds`` rounds of plain FedAvg come first: default 0, as ``L-DAWA-Agg.py``; the
CIFAR-10 script ``main_CIFAR10_LDAWA.py`` aggregates by FedAvg while the round it was
(re)started from is <= 2.

With eta_g (``train.global_lr``) the step is x^{t+1} = x^t + eta_g (A - x^t), A the
aggregate above (eta_g = 1: A itself).

In fedmpi's protocol the worker computes delta_k^l from the upload as the server decodes
it (x^t + the decoded Delta_k, so a lossy codec is seen as the server would see it) and
folds w_k delta_k^l Delta_k (d), the L per-layer w_k delta_k^l and w_k into the existing
reduce; the server then applies A - x = (S + (C^l - W) x) / W (none) or S / C^l
(cosines), S = sum_k w_k delta_k^l Delta_k, C^l = sum_k w_k delta_k^l, W = sum_k w_k.
Messages d down, d up: a deployment's server receives each model and computes the
cosines and the L normalisers itself, so those L values are a simulation artefact (they
travel in the simulator's reduce, mpi_bytes, never in fl_bytes). Client state: the
backbone's (BYOL: target and a flag; SimSiam, SimCLR: none); server state: none.
Diagnostics: ``ldawa_cos_mean`` and ``ldawa_cos_min``, the mean and the smallest over
layers of the weighted mean cosine sum_k w_k delta_k^l / sum_k w_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import register
from .byol import BYOLParams
from .fedbyol import OnBackbone
from .params import param

BACKBONES = ("simsiam", "simclr", "byol")
WEIGHTINGS = ("uniform", "samples")
NORMALISE = ("none", "cosines")
GRANULARITY = ("layer", "module")


@dataclass(frozen=True)
class LDAWAParams(BYOLParams):
    backbone: str = param("simsiam", BACKBONES,
                          "client method: simsiam (FedU^2's L-DAWA baseline) | simclr | byol")
    temperature: float = param(0.07, "(0, inf)", "NT-Xent temperature (simclr)")
    weighting: str = param("uniform", WEIGHTINGS,
                           "client weight w_k: uniform (1/K, the authors' code) | samples (n_k)")
    normalise: str = param("none", NORMALISE,
                           "none: sum_k w_k cos_k^l theta_k^l / sum_k w_k (the authors' code) | "
                           "cosines: / sum_k w_k cos_k^l (FedU^2's re-implementation)")
    granularity: str = param("layer", GRANULARITY,
                             "one cosine per parameter tensor (layer, the paper's) or per "
                             "top-level module: encoder, projector, predictor (module, FedU^2's "
                             "code)")
    warmup_rounds: int = param(0, ">= 0", "rounds of plain FedAvg before L-DAWA (the authors' "
                                          "aggregation function has none)")


def layer_table(rows, granularity: str):
    """(sizes, group, angular) of a flat layout's slots, rows = [(name, shape)] in flat
    order: each slot's number of values, the index of the layer (or module) it belongs to,
    and per layer whether it has an angle (False: only 0-d tensors, delta = 1)."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in rows]
    keys = [name if granularity == "layer" else name.split(".")[0] for name, _ in rows]
    index: dict[str, int] = {}
    group = [index.setdefault(key, len(index)) for key in keys]
    angular = [False] * len(index)
    for (_, shape), g in zip(rows, group):
        angular[g] = angular[g] or len(shape) > 0
    return sizes, group, angular


@register
class LDAWA(OnBackbone):
    name = "ldawa"
    paper = "Rehman et al. 2023, arXiv:2307.07393"
    Params = LDAWAParams
    diagnostic_fields = ("ldawa_cos_mean", "ldawa_cos_min")

    def __init__(self, params=None):
        super().__init__(params)
        self._rows = None    # [(name, shape)] of the flat layout, from build_model
        self._table = None   # layer_table(self._rows): sizes, group, angular
        self._device_table = {}   # device -> (group, angular, sizes, each layer's slots)

    # ---- the layout ----
    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        module = super().build_model(build, name, in_channels, num_classes, image_size, options)
        # the flat order of fedmpi.flat.FlatModel: parameters, then floating buffers
        rows = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        rows += [(n, tuple(b.shape)) for n, b in module.named_buffers() if b.is_floating_point()]
        self.use_layout(rows)
        return module

    def use_layout(self, rows) -> None:
        """The slots (name, shape) of the flat vector, in order; build_model sets them on
        every rank (the server needs the number of layers before any client trains)."""
        self._rows = [(str(n), tuple(shape)) for n, shape in rows]
        self._table = layer_table(self._rows, self.params.granularity)
        self._device_table = {}

    @property
    def num_layers(self) -> int:
        """L: the per-layer normalisers each client contributes (0 before the layout is known)."""
        return 0 if self._table is None else len(self._table[2])

    def _tables(self, device):
        if device not in self._device_table:
            sizes, group, angular = self._table
            members = [torch.tensor([i for i, g in enumerate(group) if g == layer],
                                    dtype=torch.int64, device=device)
                       for layer in range(len(angular))]
            self._device_table[device] = (
                torch.tensor(group, dtype=torch.int64, device=device),
                torch.tensor(angular, dtype=torch.bool, device=device),
                torch.tensor(sizes, dtype=torch.int64, device=device), members)
        return self._device_table[device]

    def _per_value(self, per_layer: torch.Tensor) -> torch.Tensor:
        """A per-layer vector [L] expanded to the flat vector's d values."""
        group, _, sizes, _ = self._tables(per_layer.device)
        return torch.repeat_interleave(per_layer[group], sizes, output_size=sum(self._table[0]))

    # ---- client ----
    def local_update(self, task, payload, client_state, ctx):
        rows = [(n, tuple(s)) for n, s, _ in task.model.layout_rows()]
        if self._rows is None:
            self.use_layout(rows)
        elif rows != self._rows:
            raise ValueError("ldawa: the worker's flat layout differs from the one build_model saw")
        upload = self.backbone_update(task, payload, client_state, ctx)
        if ctx.round >= self.params.warmup_rounds:
            upload.extras["ldawa_x"] = payload["x"]   # x^t for the cosines (a reference; never sent)
        return upload

    def layer_cosines(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """delta^l = min(cos(theta^l, x^l), 1) per layer [L]; 1 where either norm is 0
        or the layer is 0-d."""
        sizes = self._table[0]
        parts = list(zip(theta.split(sizes), x.split(sizes)))
        slot = torch.stack([torch.stack([torch.dot(a, b), torch.dot(a, a), torch.dot(b, b)])
                            for a, b in parts])                         # [slots, 3]
        _, mask, _, members = self._tables(theta.device)
        # a module's sums in slot order, with fixed indices (deterministic, no host sync)
        per_layer = slot if self.params.granularity == "layer" else \
            torch.stack([slot.index_select(0, m).sum(0) for m in members])
        dot, tt, xx = per_layer.unbind(1)
        defined = mask & (tt > 0) & (xx > 0)
        cos = dot / torch.sqrt(torch.where(defined, tt * xx, torch.ones_like(tt)))
        return torch.where(defined, torch.clamp(cos, max=1.0), torch.ones_like(cos))

    def contribution_sizes(self, d, phase=None):
        return {"delta": d, "layer_weight": self.num_layers, "weight": 1}

    def contribution(self, upload):
        delta = upload.delta
        n = float(upload.num_samples)
        x = upload.extras.get("ldawa_x")
        if x is None:   # a warm-up round: FedAvg's contribution
            return {"delta": delta * n,
                    "layer_weight": torch.full((self.num_layers,), n, dtype=delta.dtype,
                                               device=delta.device),
                    "weight": torch.tensor([n], dtype=delta.dtype, device=delta.device)}
        w = n if self.params.weighting == "samples" else 1.0
        coef = self.layer_cosines(x + delta, x) * w          # w_k delta_k^l, [L]
        return {"delta": delta * self._per_value(coef), "layer_weight": coef,
                "weight": torch.tensor([w], dtype=delta.dtype, device=delta.device)}

    # ---- server ----
    def server_update(self, state, sums, gathered, ctx):
        if ctx.round < self.params.warmup_rounds:
            return super().server_update(state, sums, gathered, ctx)
        x, s = state["x"], sums["delta"]
        c = self._per_value(sums["layer_weight"].to(x.device, x.dtype))
        if self.params.normalise == "cosines":
            safe = torch.where(c != 0, c, torch.ones_like(c))
            x.add_(torch.where(c != 0, s / safe, torch.zeros_like(s)), alpha=ctx.global_lr)
            return
        # host sync: server, once per round
        weight = float(sums["weight"])
        x.add_(s + (c - weight) * x, alpha=ctx.global_lr / weight)

    def diagnostics(self, state, sums, gathered, ctx):
        # host sync: none, server diagnostics on the reduced sums (host tensors)
        mean = (sums["layer_weight"] / sums["weight"]).double().cpu().numpy()
        angular = np.asarray(self._table[2] if self._table is not None else [], dtype=bool)
        if mean.size != angular.size or not np.any(angular):
            return {"ldawa_cos_mean": float("nan"), "ldawa_cos_min": float("nan")}
        return {"ldawa_cos_mean": float(np.mean(mean[angular])),
                "ldawa_cos_min": float(np.min(mean[angular]))}
