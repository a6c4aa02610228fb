"""DP-SGD's clipped sum of per-sample gradients without the per-sample gradients, for a
model whose parameters all sit in Linear and Conv2d layers (the 2NN, the McMahan CNN):
the ghost norm (Goodfellow 2015, "Efficient per-example gradient computations"; Li et al.
2022, "Large language models can be strong differentially private learners") and
book-keeping (Bu et al. 2023, "Differentially private optimization on large model at
small cost").

One forward pass records each layer's input a (hooks), one backward pass gives the loss's
gradient g at each layer's output and nothing else (``torch.autograd.grad`` to the
outputs: no weight gradient is formed). A Linear layer's per-sample weight gradient is
g_i a_i^T, whose squared norm is |a_i|^2 |g_i|^2 for a [B, k] input: the norms cost two
row sums. A convolution's (and a Linear layer's over a sequence) is materialised per
layer, g_i unfold(a_i)^T, which is small where convolutions are (their weights are). With
every sample's norm the clip factors c_i = min(1, C / |grad_i|) follow, and each layer's
clipped sum is one product, (c * g)^T a: the same work as the plain step's weight
gradient. No [B, d] rows are formed, nor B copies of the parameters.

A model with another parameterised layer (an LSTM, an embedding, normalisation layers),
a layer called more than once in a forward pass, or a string padding takes the general
path (``group_sgd.GroupModel``'s per-sample rows).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..algorithms.local_sgd import CLIP_EPS

_GHOSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ghost_of(flat):
    """The flat model's Ghost (built once), or None where its layers do not allow one."""
    if flat not in _GHOSTS:
        _GHOSTS[flat] = Ghost(flat) if supported(flat.module) else None
    return _GHOSTS[flat]


def supported(module: nn.Module) -> bool:
    """Whether every parameter is a Linear's or a plain Conv2d's weight or bias."""
    owned = set()
    for m in module.modules():
        if isinstance(m, nn.Linear) or (
                isinstance(m, nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros"
                and not isinstance(m.padding, str)):
            owned.update(id(p) for p in m.parameters(recurse=False))
    return bool(owned) and all(id(p) in owned for p in module.parameters())


class Ghost:
    """The clipped per-sample gradient sum of one batch, written into ``flat.grads``."""

    def __init__(self, flat):
        self.flat = flat
        self.layers = [m for m in flat.module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        views = {s.name: flat._view(flat.grads, s) for s in flat.layout
                 if s.offset < flat.num_params}
        names = {id(p): n for n, p in flat.module.named_parameters()}
        self.views = [(views[names[id(m.weight)]],
                       None if m.bias is None else views[names[id(m.bias)]])
                      for m in self.layers]

    def clipped_sum(self, x, y, clip: float, autocast=None):
        """Sum over the batch of each sample's loss gradient clipped to L2 norm ``clip``,
        into ``flat.grads``; returns the per-sample losses, or None where a layer was not
        called exactly once (the caller takes the general path)."""
        inputs, outputs = {}, {}

        def record(module, args, out):
            inputs.setdefault(module, []).append(args[0].detach())
            outputs.setdefault(module, []).append(out)

        hooks = [m.register_forward_hook(record) for m in self.layers]
        try:
            ctx = torch.autocast(x.device.type, dtype=autocast) if autocast is not None \
                else nullcontext()
            with ctx:
                logits = self.flat.module(x)
        finally:
            for hook in hooks:
                hook.remove()
        if any(len(outputs.get(m, ())) != 1 for m in self.layers):
            return None
        losses = F.cross_entropy(logits.float(), y, reduction="none")
        grads = torch.autograd.grad(losses.sum(), [outputs[m][0] for m in self.layers])
        pieces = [_pieces(m, inputs[m][0].float(), g.float()) for m, g in zip(self.layers, grads)]
        squares = sum(sq for _, _, sq in pieces)
        factors = torch.clamp(clip / (squares.sqrt() + CLIP_EPS), max=1.0)
        for (weight, bias), (w, b, _) in zip(self.views, pieces):
            weight.copy_(w(factors).view(weight.shape))
            if bias is not None:
                bias.copy_(factors @ b)
        return losses.detach()


def _pieces(layer, a: torch.Tensor, g: torch.Tensor):
    """(the clipped weight sum as a function of the factors c [B], the per-sample bias
    gradients [B, o], each sample's squared gradient norm in this layer [B])."""
    batch = a.shape[0]
    if isinstance(layer, nn.Linear) and a.dim() == 2:        # the ghost norm
        bias = g
        squares = a.pow(2).sum(1) * g.pow(2).sum(1)

        def weight(c):
            return (g * c.unsqueeze(1)).t() @ a
    else:                                                    # per sample, this layer only
        if isinstance(layer, nn.Conv2d):
            a = F.unfold(a, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
            g = g.reshape(batch, g.shape[1], -1)             # [B, o, T], a [B, k, T]
        else:                                                # Linear over a sequence
            a = a.reshape(batch, -1, a.shape[-1]).transpose(1, 2)
            g = g.reshape(batch, -1, g.shape[-1]).transpose(1, 2)
        per_sample = torch.bmm(g, a.transpose(1, 2)).reshape(batch, -1)   # [B, o k]
        bias = g.sum(2)
        squares = per_sample.pow(2).sum(1)

        def weight(c):
            return c @ per_sample
    if layer.bias is not None:
        squares = squares + bias.pow(2).sum(1)
    return weight, bias, squares
