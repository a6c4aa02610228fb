"""FedBYOL: BYOL clients with a local target, online networks averaged by FedAvg.

Grill et al., "Bootstrap Your Own Latent", NeurIPS 2020, https://arxiv.org/abs/2006.07733;
federated as in EasyFL applications/fedssl (Zhuang et al., the FedU/FedEMA authors).

Client k: online theta (encoder f, projector g, predictor q) <- x^t; target xi_k (f, g)
kept on the client, xi_k <- x^t_[f, g] at its first participation; E epochs of BYOL
(fedmpi.algorithms.byol: loss 2 - 2cos(p, sg t) both ways, then xi_k <- tau xi_k +
(1 - tau) theta_[f, g] after every step); upload Delta_k = theta_K - x^t.
Server: x^{t+1} = x^t + eta_g sum_k n_k Delta_k / sum_k n_k (f, g and q).
Messages d down, d up (d = online incl. predictor; the target never travels).
Client state: target xi_k (d - |q|), seen (1: 0 until the first participation; the store
hands out zeros for a client without state).

FedU and FedEMA change only where the online and target networks start (``start``) and
what else the client keeps (``extra_state``).
"""

from __future__ import annotations

import torch

from .base import Algorithm, Upload, register
from .byol import BYOLParams, byol_train, predictor_size, target_model
from .mixins import SelfSupervised
from .ssl_losses import byol_head, simclr_head, simsiam_head


@register
class FedBYOL(SelfSupervised, Algorithm):
    name = "fedbyol"
    paper = "Grill et al. 2020, arXiv:2006.07733 (federated: EasyFL fedssl)"
    Params = BYOLParams

    def __init__(self, params=None):
        super().__init__(params)
        self._target = None   # (the worker's flat model, its target network): a cache only

    def predictor(self):
        return True

    def target_size(self, d: int) -> int:
        """|xi| = |f| + |g|: the flat prefix before the predictor."""
        return d - predictor_size(self.params)

    def client_state_sizes(self, d):
        return {"target": self.target_size(d), "seen": 1}

    # ---- the hooks FedU / FedEMA override ----
    def start(self, x, client_state, ctx, seen: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(theta_0, xi_0) of this local update: the global model and the client's target
        (the global encoder + projector at the first participation)."""
        return x, (client_state["target"] if seen else x[:self.target_size(len(x))])

    def extra_state(self, task, start, client_state, ctx, seen: bool) -> dict:
        """State kept next to the target, from theta_0 = ``start`` and theta_K (the model)."""
        return {}

    def loss_head(self, target_module):
        """The loss on the projections of both views (FedU^2 adds its regulariser)."""
        return byol_head(target_module)

    # ---- client ----
    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        seen = bool(client_state["seen"].item())  # host sync: once per client
        start, target_start = self.start(x, client_state, ctx, seen)
        task.model.load(start)
        target = self._target_of(task.model)
        target.load(target_start)
        loss, steps = byol_train(task, ctx, target, self.params.tau_ema, head=self.loss_head)
        w = task.model.params
        state = {"target": target.params.clone(), "seen": torch.ones(1, device=w.device),
                 **self.extra_state(task, start, client_state, ctx, seen)}
        return Upload(delta=w - x, num_samples=task.data.num_samples, loss=loss, steps=steps,
                      state=state)

    def _target_of(self, flat):
        """The worker's target network, built once per worker model."""
        if self._target is None or self._target[0] is not flat:
            target = target_model(flat)
            if target.size != self.target_size(flat.size):
                raise ValueError(f"target network has {target.size} values, expected "
                                 f"{self.target_size(flat.size)} (d - predictor)")
            self._target = (flat, target)
        return self._target[1]


class OnBackbone(FedBYOL):
    """A method over a BYOL, SimCLR or SimSiam client (``params.backbone``; FedU^2,
    FedDecorr-SSL, L-DAWA): with "byol" FedBYOL's client (local target, EMA, its state),
    otherwise ``train_on_views`` on SimCLR's (``params.temperature``) or SimSiam's loss;
    ``regularised`` adds the method's own term to whichever loss it is."""

    @property
    def _byol(self) -> bool:
        return self.params.backbone == "byol"

    def predictor(self):
        return self.params.backbone != "simclr"

    def client_state_sizes(self, d):
        return super().client_state_sizes(d) if self._byol else {}

    def regularised(self, head):
        """The client loss ``head`` with the method's own term (none here)."""
        return head

    def loss_head(self, target_module):
        return self.regularised(byol_head(target_module))

    def backbone_update(self, task, payload, client_state, ctx) -> Upload:
        """The backbone's local update with ``regularised``'s loss."""
        if self._byol:
            return FedBYOL.local_update(self, task, payload, client_state, ctx)
        head = simclr_head(self.params.temperature) if self.params.backbone == "simclr" \
            else simsiam_head
        return self.train_on_views(task, payload["x"], ctx, self.regularised(head))

    def local_update(self, task, payload, client_state, ctx):
        return self.backbone_update(task, payload, client_state, ctx)

