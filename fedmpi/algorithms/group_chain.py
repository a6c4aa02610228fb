"""A client group's gradient written out, for a model that is a chain of plain layers.

``torch.func.vmap(grad(...))`` differentiates any model over a group's parameter rows,
but most of the operators it runs are views, transposes and reshapes of those rows and
of their batched copies. Where the host launches every operator (a GPU with small
clients) the operators are the step's time. For a model whose forward is a chain of
Conv2d, ReLU, MaxPool2d, Flatten and Linear layers (the McMahan CNN, the 2NN, the
tabular MLP: the model's ``chain()``), the gradient is written out here. The gradient
of a W2 step, 50 clients' batches of 10 Fashion-MNIST images, as torch.profiler counts
operators, on a 2-core CPU (``benchmarks/cross_device.py --profile --model cnn``): the
CNN 181 operators and 150 ms, against vmap's 484 and 271 ms; the 2NN 86 and 8.3 ms,
against 284 and 9.5 ms.

- in the image part a group's activations are [B, a C, H, W]: sample b of every client,
  the clients' channels side by side, so one grouped convolution (groups = a) applies
  every client's own filters, and one ``convolution_backward`` gives the input's,
  filters' and biases' gradients; in FlatModel's channels-last layout the activations
  are channels-last too on a CPU, as the sequential path's (175 against 192 ms NCHW, a
  W2 CNN step's gradient on 2 cores), and NCHW on a GPU (cuDNN's grouped convolutions
  over channels-last FP32 activations convert layouts client by client: 6.3 ms
  channels-last, 3.6 ms NCHW on an H200);
- Flatten moves to [a, B, F], where one batched matrix product a layer (bias added in
  it) applies every client's own Linear layer; the backward of the mean (or weighted)
  cross-entropy is softmax minus one-hot, then dW = dz^T h, db = sum dz, dh = dz W;
- a ReLU followed by a max-pool is pooled first: the maximum commutes with the ReLU (a
  monotone map that keeps ties), so values, indices and gradients are the same bits, and
  the ReLU and its backward touch a quarter of the values.

The kernels are the ones autograd calls (``convolution``, ``convolution_backward``,
``max_pool2d_with_indices`` and its backward, ``threshold_backward``, ``bmm``), so a
row's losses and gradient are vmap's up to float rounding (``tests/test_client_groups.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from ..flat import FlatModel

aten = torch.ops.aten


@dataclass(frozen=True)
class Layer:
    """One step of a chain: ``kind`` is conv, linear, relu, pool or flatten; a conv or
    linear layer's ``weight`` and ``bias`` are offsets in the flat rows and ``shape`` its
    weight's ([out, in, kh, kw] or [out, in]); ``options`` a conv's (stride, padding,
    dilation) or a pool's (kernel, stride, padding, dilation, ceil_mode)."""
    kind: str
    weight: int = 0
    bias: int = 0
    shape: tuple = ()
    options: tuple = ()


IMAGE = ("conv", "pool", "relu")   # what the image part (before Flatten) may hold
FLAT = ("linear", "relu")          # and what the flat part may


def layer_chain(flat: FlatModel) -> list[Layer] | None:
    """``flat``'s model as Layers, where its ``chain()`` names the layers whose
    composition is its forward, these hold all its parameters in storage order, and
    every layer is one this module writes out (torch's own biased Conv2d and Linear,
    zero-padded convolutions with groups = 1, ReLU, MaxPool2d, Flatten(1, -1), not
    subclasses of them) in an image part then a flat part ending in a Linear; else
    None."""
    modules = getattr(flat.module, "chain", lambda: None)()
    if not modules:
        return None
    names = {id(p): n for n, p in flat.module.named_parameters()}
    slots = {s.name: s for s in flat.layout}
    layers = []
    for m in modules:   # exact types: a subclass may compute something else
        kind = type(m)
        if kind in (nn.Linear, nn.Conv2d) and m.bias is not None:
            if id(m.weight) not in names or id(m.bias) not in names:
                return None   # a layer that is not the model's own
            w, b = slots[names[id(m.weight)]].offset, slots[names[id(m.bias)]].offset
            if kind is nn.Linear:
                layers.append(Layer("linear", w, b, (m.out_features, m.in_features)))
            elif m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str):
                layers.append(Layer("conv", w, b, tuple(m.weight.shape),
                                    (tuple(m.stride), tuple(m.padding), tuple(m.dilation))))
            else:
                return None
        elif kind is nn.ReLU:
            layers.append(Layer("relu"))
        elif kind is nn.MaxPool2d and not m.return_indices:
            layers.append(Layer("pool", options=(
                _pair(m.kernel_size), _pair(m.stride or m.kernel_size),
                _pair(m.padding), _pair(m.dilation), m.ceil_mode)))
        elif kind is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            layers.append(Layer("flatten"))
        else:
            return None
    while layers and layers[0].kind == "flatten":
        layers.pop(0)   # the input's flattening: a group's flat inputs are x [a, B, F]
    kinds = [layer.kind for layer in layers]
    if not kinds:
        return None
    image, rest = [], kinds
    if "flatten" in kinds:
        cut = kinds.index("flatten")
        image, rest = kinds[:cut], kinds[cut + 1:]
    stored = [s.offset for s in flat.layout if s.offset < flat.num_params]
    if (any(k not in IMAGE for k in image) or any(k not in FLAT for k in rest)
            or kinds[0] == "relu" or kinds[-1] != "linear"
            or [o for layer in layers if layer.kind in ("conv", "linear")
                for o in (layer.weight, layer.bias)] != stored):
        return None
    for i in range(len(layers) - 1):   # ReLU then max-pool: pool first, the same bits
        if kinds[i] == "relu" and kinds[i + 1] == "pool":
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
            kinds[i], kinds[i + 1] = kinds[i + 1], kinds[i]
    return layers


def grouped_images(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A group's images x [a, B, C, H, W] as [B, a C, H, W] (channels-last if asked),
    one copy."""
    a, b, c, h, w = x.shape
    if not channels_last:
        return x.transpose(0, 1).reshape(b, a * c, h, w)
    out = torch.empty(b, h, w, a, c, device=x.device, dtype=x.dtype)
    out.copy_(x.permute(1, 3, 4, 0, 2))
    return out.view(b, h, w, a * c).permute(0, 3, 1, 2)


def layer_params(layers: list[Layer], rows: torch.Tensor, channels_last: bool) -> list:
    """The parameters of a group's rows ([a, d]) as each layer takes them: a conv's
    filters [a, out, kh, kw, in] (as FlatModel stores them channels-last, else [a, out,
    in, kh, kw]) and biases [a, out]; a Linear's weights [a, out, in], their transpose
    and biases [a, 1, out]. Views of ``rows``, made once for a group size
    (``GroupModel.views``)."""
    a, params = rows.shape[0], []
    for layer in layers:
        if layer.kind == "conv":
            out, c, kh, kw = layer.shape
            w = rows[:, layer.weight:layer.weight + out * c * kh * kw]
            params.append((w.view(a, out, kh, kw, c) if channels_last
                           else w.view(a, out, c, kh, kw), rows[:, layer.bias:layer.bias + out]))
        elif layer.kind == "linear":
            out, inp = layer.shape
            w = rows[:, layer.weight:layer.weight + out * inp].view(a, out, inp)
            params.append((w, w.transpose(1, 2), rows[:, layer.bias:layer.bias + out].unsqueeze(1)))
        else:
            params.append(None)
    return params


def chain_pieces(layers: list[Layer], params: list, x, y, weights, classes: torch.Tensor,
                 channels_last: bool, nhwc: bool):
    """(per-row loss [a], the gradient as one [a, numel] piece a parameter in storage
    order) of a group's first a rows, whose parameters are ``params``
    (``layer_params``, filters stored channels-last if ``channels_last``), for one batch
    a row (x [a, B, ...], y [a, B]; ``weights`` [a, B] or None for the plain mean), by
    the chain ``layers``, with channels-last activations if ``nhwc`` (which needs
    ``channels_last``)."""
    a, b = y.shape
    h = grouped_images(x, nhwc) if layers[0].kind in IMAGE else x.reshape(a, b, -1)
    saved = []   # what each layer's backward needs
    for layer, p in zip(layers, params):
        if layer.kind == "conv":
            # the clients' filters one after another, as a grouped convolution takes them:
            # a copy (a row holds all its client's parameters, so they are d apart)
            out, c, kh, kw = layer.shape
            if nhwc:
                w = p[0].reshape(a * out, kh, kw, c).permute(0, 3, 1, 2)
            elif channels_last:
                w = p[0].permute(0, 1, 4, 2, 3).reshape(a * out, c, kh, kw)
            else:
                w = p[0].reshape(a * out, c, kh, kw)
            saved.append((h, w))
            h = F.conv2d(h, w, p[1].reshape(a * out), *layer.options, groups=a)
        elif layer.kind == "pool":
            out, idx = aten.max_pool2d_with_indices(h, *layer.options)
            saved.append((h, idx))
            h = out
        elif layer.kind == "relu":
            h = h.relu_()   # always a layer's own output (a chain never starts with one)
            saved.append(h)
        elif layer.kind == "flatten":
            saved.append(h.shape)
            h = h.reshape(b, a, -1).transpose(0, 1)
        else:
            saved.append((h, p[0]))
            h = torch.baddbmm(p[2], h, p[1])
    logp = torch.log_softmax(h.float(), dim=-1)
    picked = logp.gather(2, y.unsqueeze(2)).squeeze(2)
    g = logp.exp_().sub_((y.unsqueeze(2) == classes).to(logp.dtype))
    if weights is None:
        losses = picked.mean(dim=1).neg_()
        g.mul_(1.0 / b)
    else:
        losses = (picked * weights).sum(dim=1).neg_()
        g.mul_(weights.unsqueeze(2))
    g = g.to(h.dtype)
    first = next(i for i, layer in enumerate(layers) if layer.kind in ("conv", "linear"))
    pieces = []
    for i in range(len(layers) - 1, first - 1, -1):
        layer, s = layers[i], saved[i]
        if layer.kind == "linear":
            pieces += [g.sum(dim=1), torch.bmm(g.transpose(1, 2), s[0]).view(a, -1)]
            if i > first:
                g = torch.bmm(g, s[1])
        elif layer.kind == "relu":
            g = aten.threshold_backward(g, s, 0)
        elif layer.kind == "flatten":
            g = g.transpose(0, 1).reshape(s)
        elif layer.kind == "pool":
            g = aten.max_pool2d_with_indices_backward(g, s[0], *layer.options[:4],
                                                      layer.options[4], s[1])
        else:
            out, c, kh, kw = layer.shape
            gi, gw, gb = aten.convolution_backward(g, s[0], s[1], [a * out], *layer.options,
                                                   False, [0, 0], a, [i > first, True, True])
            gw = gw.reshape(a, out, c, kh, kw)
            pieces += [gb.view(a, out),
                       (gw.permute(0, 1, 3, 4, 2) if channels_last else gw).reshape(a, -1)]
            g = gi
    return losses, pieces[::-1]
