"""FedX: unsupervised federated learning with cross knowledge distillation, over SimCLR
(the authors' code) or BYOL (FedU^2's "FedX-BYOL").

Han, Park, Wu, Kim, Wu, Xie, Cha, "FedX: Unsupervised Federated Learning with Cross
Knowledge Distillation", ECCV 2022, https://arxiv.org/abs/2207.09158 (code:
Sungwon-Han/FEDX, ``main.py`` ``train_net_fedx``, ``losses.py``, ``model.py``).

Client k, from the global model x^t (encoder f, projector g, predictor q) with a frozen
copy G of x^t (encoder + projector, no gradient): per step, views v1, v2 of the batch and
anchors a (the anchor batch below),

    z_v = g(f(v_v)),  p_v = q(z_v),  r = g(f(a)),  z^G_2 = G(v2),  r^G = G(a),

    L =   L_local(v1, v2)                                       (the backbone's own loss)
        + lambda_local_rel  * Rel(z_1, z_2; r;   T, T_s)        (local relational)
        + lambda_global_con * NT-Xent(p_1, z^G_2; T)            (global contrastive)
        + lambda_global_rel * Rel(p_1, p_2; r^G; T, T_t)        (global relational)

with L_local = NT-Xent(z_1, z_2; T) for ``backbone = "simclr"`` (default, the code's) and
L_local = BYOL's 2 - 2cos(p_1, sg t_2) + 2 - 2cos(p_2, sg t_1), t_v = xi_k(v_v) from the
client's target xi_k, for ``backbone = "byol"``, and the relational loss of the code's
``js_loss``: s_v = cos(u_v, anchors) row-wise (B x A), q_v = softmax(s_v / T),
M = (softmax(s_1 / T') + softmax(s_2 / T')) / 2, Rel = (KL(M || q_1) + KL(M || q_2)) / 2,
each KL summed over the anchors and averaged over the B rows ("batchmean"). E local epochs
of SGD; upload Delta_k = w_K - x^t (all of f, g, q). BYOL: the target xi_k (encoder +
projector) is FedBYOL's (fedmpi.algorithms.fedbyol, byol): x^t_[f, g] at the client's
first participation, then kept on the client, xi_k <- tau xi_k + (1 - tau) w_[f, g] after
every step (``tau_ema``, 0.99). Server: FedAvg, x^{t+1} = x^t + eta_g sum_k n_k Delta_k /
sum_k n_k. Messages d down, d up (the target never travels). Client state: none (simclr);
FedBYOL's target (d - |q|) and seen flag (1) (byol). No server state.

Choices (paper / code / fedmpi), each with the parameter that selects it:

- Backbone: the paper applies FedX to five SSL methods (BYOL among them) but the
  authors' code releases only SimCLR (no --method or BYOL option; its first commit keeps
  an unused update_ema_variables, nothing else), and FedU^2's code (XeniaLLL/FedU2,
  src/my/algo/fedx) is the same SimCLR client. ``backbone = "byol"`` is fedmpi's form of
  the paper's recipe: BYOL's loss replaces the local contrastive term, FedBYOL's client
  pieces (target, EMA, state) reused; the three FedX terms read what they read in the
  code. One predictor q: BYOL's, also the one the global terms read (the code's
  predictionMLP has BYOL's shape; a second head is in no reference). G is the received
  global model x^t, not the client's target. The target sees only the two views.
- Weights: the code sums the four terms with weight 1 (``loss = loss_nt + loss_js``);
  ``lambda_local_rel``, ``lambda_global_con``, ``lambda_global_rel`` default to 1, and 0
  switches a term off (not computed). With all three 0 the method is its backbone bit for
  bit: FedSimCLR (no anchors drawn, no frozen model, and no predictor in the network: it
  is built with simclr only when a global term uses it) or FedBYOL (same model and state).
- Temperatures (the code's flags): ``temperature`` = --temperature = 0.1 (both NT-Xent
  terms and the student side T of both relational terms); ``tau_target_local`` = --ts =
  0.1 (the target T_s of the local relational term); ``tau_target_global`` = --tt = 0.1
  (the target T_t of the global one). The code's names are crossed (--ts, "student", is
  the local term's target temperature); fedmpi names the terms.
- Which heads (the code's, either backbone): the local relational term reads the
  projector z (``proj1``), the global contrastive term pairs the local *predictor* output
  of view 1 with the global *projection* of view 2 (``nt_xent(pred1_original,
  proj2_pos)``; one direction, not symmetrised, the 2B-row NT-Xent over [p_1; z^G_2], no
  gradient into z^G_2), and the global relational term compares the local predictor
  outputs of both views against the global projections of the anchors.
- Relational loss as coded, not a textbook JS divergence: F.kl_div(log q_v, M) is
  KL(M || q_v), and the mixture M keeps its gradient (not detached), as do the local
  anchors r (the local model's own projections). With T' = T this is the
  Jensen-Shannon-like (KL(M||q_1) + KL(M||q_2)) / 2, not JS = (KL(q_1||M) + KL(q_2||M)) / 2.
- Network: the code's ModelFedX has projectionMLP Linear(F, 256) -> ReLU -> Linear(256,
  256) and predictionMLP Linear(256, 256) -> ReLU -> Linear(256, 256), no normalisation.
  fedmpi's SSLNet projector and predictor (Linear -> [LayerNorm] -> ReLU -> Linear) are
  exactly these with ``proj_dim = proj_hidden = pred_hidden = 256`` and ``head_norm =
  "none"``, the defaults here for both backbones (the other SSL methods default to
  FedU^2's 512/2048/layer). The global model runs in eval mode, as in the code (fedmpi's
  models have no BatchNorm, so eval changes nothing but dropout).
- Anchors: the code draws them from a second, independently shuffled loader over the
  client's data (view 1 of its next batch, restarted when exhausted), with the training
  batch and the anchor batch each batch_size // 2 = 64. fedmpi takes view 1 of the *next*
  batch of the client's own view stream (the last step wraps to the first batch): a
  random batch of the same client's data under its own augmentation, distinct from the
  current batch within an epoch, drawn from the stream keyed by (seed, round, client) that
  the training batches come from, so 1 rank and N ranks give the same bits and the
  training batches are exactly the backbone's (a short last batch and its anchors differ
  in size: the loss splits [v1; v2; anchors] by the current batch's, ``Anchored.rows``).
  ``train.batch_size`` is the code's batch_size // 2 (its 128 is fedmpi's 64, with 64
  anchors).
- The code's local optimiser is SGD with momentum 0.9, weight decay 1e-5, lr 0.01,
  10 local epochs, 10 clients all participating, 100 rounds: ``train.*`` in fedmpi.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ClientData, register
from .byol import BYOLParams
from .fedbyol import FedBYOL
from .local_sgd import FrozenCopies
from .params import param
from .ssl_losses import byol_loss, halves, nt_xent

BACKBONES = ("simclr", "byol")


def relational_loss(u1: torch.Tensor, u2: torch.Tensor, anchors: torch.Tensor,
                    temperature: float, target_temperature: float) -> torch.Tensor:
    """(KL(M || q_1) + KL(M || q_2)) / 2 over B rows ("batchmean"), the code's ``js_loss``:
    s_v = cos(u_v, anchors) [B, A], q_v = softmax(s_v / temperature), M = the mean of
    softmax(s_v / target_temperature) over the two views (gradient kept)."""
    a = F.normalize(anchors, dim=1)
    s1 = F.normalize(u1, dim=1) @ a.T
    s2 = F.normalize(u2, dim=1) @ a.T
    mixture = (F.softmax(s1 / target_temperature, dim=1)
               + F.softmax(s2 / target_temperature, dim=1)) / 2
    kl1 = F.kl_div(F.log_softmax(s1 / temperature, dim=1), mixture, reduction="batchmean")
    kl2 = F.kl_div(F.log_softmax(s2 / temperature, dim=1), mixture, reduction="batchmean")
    return (kl1 + kl2) / 2


def with_anchors(batches):
    """((v1, v2, anchors), y) from ((v1, v2), y) batches: the anchors are view 1 of the
    next batch of the same stream, the last batch's those of the first. The stream is
    read in its own order, so the training batches are exactly the ones given."""
    stream = iter(batches)
    first = next(stream, None)
    if first is None:
        return
    current = first
    for following in stream:
        yield (*current[0], following[0][0]), current[1]
        current = following
    yield (*current[0], first[0][0]), current[1]


class Anchored(ClientData):
    """A client's data whose view batches carry the anchors (``with_anchors``); ``rows`` is
    the batch size B of the batch last handed out, so a loss on [v1; v2; anchors] can split
    it (the anchors are the next batch: the last batch of an epoch and its anchors differ
    in size)."""

    def __init__(self, data: ClientData):
        self.data = data
        self.num_samples = data.num_samples
        self.rows = 0

    def view_batches(self, epochs, batch_size):
        for views, y in with_anchors(self.data.view_batches(epochs, batch_size)):
            self.rows = views[0].shape[0]
            yield views, y

    def num_steps(self, epochs, batch_size):
        return self.data.num_steps(epochs, batch_size)


def fedx_head(params: "FedXParams", target=None, glob=None, anchored: Anchored | None = None):
    """head(module, z, both) (ssl_losses.on_projections) of the FedX loss: z = g(f(both)),
    both = [v1; v2], or [v1; v2; anchors] from ``anchored`` (whose ``rows`` is B). The
    local term is NT-Xent on z (``target`` None) or BYOL of the predictor against
    ``target``'s projections (no gradient); ``glob`` is the frozen global module (None
    when no global term is on). The predictor runs once, shared by BYOL and the global terms."""
    p = params
    t = p.temperature
    rel_local, con_global, rel_global = p.lambda_local_rel, p.lambda_global_con, p.lambda_global_rel

    def head(module, z, both):
        b = z.shape[0] // 2 if anchored is None else anchored.rows
        z1, z2, r = z[:b], z[b:2 * b], z[2 * b:]
        pred = None
        if target is None:
            total = nt_xent(z1, z2, t)
        else:
            pred = module.predict(z[:2 * b])
            with torch.no_grad():
                t1, t2 = halves(target.project(both[:2 * b]))
            total = byol_loss(*halves(pred), t1, t2)
        if rel_local:
            total = total + rel_local * relational_loss(z1, z2, r, t, p.tau_target_local)
        if con_global or rel_global:
            p1, p2 = halves(module.predict(z[:2 * b]) if pred is None else pred)
            reads = ([both[b:2 * b]] if con_global else []) + ([both[2 * b:]] if rel_global else [])
            with torch.no_grad():   # the global model sees only what a term reads
                g = glob.project(torch.cat(reads))
            g2, rg = (g[:b], g[b:]) if con_global else (None, g)
            if con_global:
                total = total + con_global * nt_xent(p1, g2, t)
            if rel_global:
                total = total + rel_global * relational_loss(p1, p2, rg, t, p.tau_target_global)
        return total
    return head


@dataclass(frozen=True)
class FedXParams(BYOLParams):
    """The backbone, the heads at the code's sizes (out_dim 256, no normalisation), its
    temperatures and the weight of each FedX term (``tau_ema``: byol's target only)."""

    backbone: str = param("simclr", BACKBONES,
                          "local term: simclr (NT-Xent, the authors' code) | byol (BYOL against "
                          "a target kept on the client, FedBYOL's; FedU^2's FedX-BYOL)")
    proj_dim: int = param(256, ">= 1", "projector output size (FedX code: out_dim 256)")
    proj_hidden: int = param(256, ">= 1", "projector hidden width (FedX code: out_dim)")
    head_norm: str = param("none", ("layer", "none"),
                           "normalisation inside the heads: none (FedX code: plain "
                           "Linear-ReLU-Linear) | layer")
    pred_hidden: int = param(256, ">= 1", "predictor hidden width (FedX code: out_dim)")
    temperature: float = param(0.1, "> 0", "NT-Xent temperature of both contrastive terms and "
                                            "the student side of both relational ones (code: 0.1)")
    tau_target_local: float = param(0.1, "> 0", "target temperature of the local relational "
                                                 "term (code: --ts 0.1)")
    tau_target_global: float = param(0.1, "> 0", "target temperature of the global relational "
                                                  "term (code: --tt 0.1)")
    lambda_local_rel: float = param(1.0, ">= 0", "weight of the local relational loss (code: 1)")
    lambda_global_con: float = param(1.0, ">= 0", "weight of the global contrastive loss (code: 1)")
    lambda_global_rel: float = param(1.0, ">= 0", "weight of the global relational loss (code: 1)")


@register
class FedX(FedBYOL):
    name = "fedx"
    paper = "Han et al. 2022, arXiv:2207.09158"
    Params = FedXParams

    def __init__(self, params=None):
        super().__init__(params)
        self._frozen = FrozenCopies()   # the worker's frozen global model
        self._inputs = (None, None)   # this local update's global module and Anchored data

    @property
    def _byol(self) -> bool:
        return self.params.backbone == "byol"

    @property
    def _global_terms(self) -> bool:
        return bool(self.params.lambda_global_con or self.params.lambda_global_rel)

    @property
    def _anchors(self) -> bool:
        return bool(self.params.lambda_local_rel or self.params.lambda_global_rel)

    def predictor(self):
        """BYOL's predictor, which the global terms read too; with simclr only the global
        terms read it: without them it is not built (and the method is FedSimCLR)."""
        return self._byol or self._global_terms

    def client_state_sizes(self, d):
        return super().client_state_sizes(d) if self._byol else {}

    def loss_head(self, target_module):
        """FedBYOL's hook: the loss its client (target, EMA, state) trains on."""
        return fedx_head(self.params, target_module, *self._inputs)

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        glob = anchored = None
        if self._global_terms:
            glob, = self._frozen.of(task.model)
            glob.load(x)
            glob = glob.module
        if self._anchors:
            anchored = Anchored(task.data)
            task = dataclasses.replace(task, data=anchored)
        self._inputs = (glob, anchored)
        try:
            if self._byol:   # FedBYOL's client (target, EMA, state) on ``loss_head``
                return super().local_update(task, payload, client_state, ctx)
            return self.train_on_views(task, x, ctx, fedx_head(self.params, None, glob, anchored))
        finally:
            self._inputs = (None, None)
