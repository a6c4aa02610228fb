"""Local SGD of a group of clients in lock-step: G local updates as one computation.

Cross-device clients are small (tens of samples, batches of 10) and so are their models;
one client's step is a string of tiny kernels, and a simulator spends its time launching
them. Here the G clients' parameters are the rows of one [G, d] buffer; each step takes
one batch from every client that still has steps to run, does one forward and one
backward over all of them with per-client weights (grouped convolutions and batched
matrix products: written out for a model that is a chain of plain layers, the McMahan
CNN and 2NN, in about half the operators of the model's functional form under
``torch.func.vmap``, which serves every other model; ``group_chain``), and one update of
all rows (``local_sgd.sgd_step``'s rule row by row: per-client clipping, weight decay,
momentum, the local schedule).

Clients need not have equal step counts. The runtime hands a group in non-increasing
order of steps (``fedmpi.runtime.plan.groups``), so the clients still training at step k
are always a prefix of the rows: a client that has finished drops off the end and its
row stops changing, and no step is spent on it (no masking, no padding steps). The last
batch of an epoch may be short (n_i mod B samples): it is padded to the group's batch
size with zero-weight samples, so each client's loss is still the mean over its real
samples.

Each client reads its own batches from its own keyed stream (seed, round, client, phase)
exactly as on the sequential path, so what a client computes does not depend on who
else is in its group or on which rank trains it; only float rounding differs from the
sequential path (batched kernels sum in another order). Dropout draws from the global
generator, which a group shares, so models with dropout are refused at config time.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from ..flat import FlatModel
from . import group_chain, local_sgd, schedule
from .base import ClientTask, RoundContext, Upload

# correction(grads [a, n], params [a, n]) modifies the group's gradient rows in place; a
# per-client vector it holds as [G, d] rows applies to the a leading rows
# (``local_sgd.rows_of``), so the sequential corrections serve groups unchanged.
GroupCorrection = Callable[[torch.Tensor, torch.Tensor], None]
# gradient(model, a, x, y, weights, autocast) -> (losses [a], grads [a, n]): one batch's
# gradient for each of the first a rows of a GroupModel, ``GroupModel.gradient`` by
# default; what a hook must leave where: ``train``'s docstring.
GroupGradient = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_MODELS: "weakref.WeakKeyDictionary[FlatModel, GroupModel]" = weakref.WeakKeyDictionary()
VIEW_SIZES = 64   # group sizes whose parameter views a GroupModel keeps at once


class RowViews(NamedTuple):
    """Views of a group's first a rows, made once for each a (``GroupModel.views``)."""
    slices: list[torch.Tensor]          # each parameter's [a, numel] slice, storage order
    named: dict[str, torch.Tensor]      # ``GroupModel.params``: named [a, *shape] views
    layers: list | None                 # the chain's ``group_chain.layer_params``, if any


class GroupModel:
    """The functional form of a FlatModel's module over a [G, d] parameter buffer ``rows``
    and a [G, n] gradient buffer ``grad_rows``.

    The flat storage order (channels-last 4-D weights included) is the FlatModel's, so a
    row is exactly what ``FlatModel.load`` takes and a client's delta is row - x. The
    gradient is ``torch.func.vmap(torch.func.grad(...))`` of one client's loss over the
    rows' parameter views (``chain_pieces`` by hand for a chain of plain layers), written
    into ``grad_rows`` with one concatenation. (Measured on a 2-core CPU, 2NN, G = 50:
    vmap took 0.13 ms a client-step, against 0.21 ms with autograd accumulating into
    strided ``.grad`` views and 1.2 ms differentiating with respect to the flat rows,
    whose every slice's backward fills a zero [G, d] tensor.)"""

    def __init__(self, flat: FlatModel):
        self.flat = flat
        self.slots = [(s.name, s.shape, s.offset, s.numel, flat._nhwc(s))
                      for s in flat.layout if s.offset < flat.num_params]
        self.rows = torch.empty(0, flat.size, device=flat.params.device, dtype=flat.params.dtype)
        self.grad_rows = torch.empty(0, flat.num_params, device=self.rows.device,
                                     dtype=self.rows.dtype)
        self._grad_mean = vmap(grad_and_value(self._mean_loss))
        self._grad_weighted = vmap(grad_and_value(self._weighted_loss))
        self.chain = group_chain.layer_chain(flat)
        # the chain's activations: channels-last where the weights are stored so, on a
        # CPU only (faster there; on a GPU NCHW is, see group_chain; tests may set it)
        self.nhwc = flat.channels_last and self.rows.device.type == "cpu"
        self._views: dict[int, RowViews] = {}   # a -> views of rows[:a] (``views``)
        self._inside: dict[tuple[int, int], list[int]] = {}   # span -> its slots (``inside``)
        # the chain's class ids, for its one-hot (F.one_hot would sync a GPU every step)
        self.classes = None if self.chain is None else \
            torch.arange(self.chain[-1].shape[0], device=self.rows.device)

    def _mean_loss(self, params, x, y):
        return F.cross_entropy(functional_call(self.flat.module, params, (x,)).float(), y)

    def _weighted_loss(self, params, x, y, weights):
        logits = functional_call(self.flat.module, params, (x,)).float()
        return (F.cross_entropy(logits, y, reduction="none") * weights).sum()

    def loss(self, params, x, y, weights=None):
        """One row's batch loss at ``params`` (named tensors): the mean, or weighted
        (padding), as ``gradient`` differentiates it (for hooks composing torch.func)."""
        return self._mean_loss(params, x, y) if weights is None else \
            self._weighted_loss(params, x, y, weights)

    def buffer(self, g: int) -> torch.Tensor:
        """The first g rows of the group buffer, grown when needed."""
        if self.rows.shape[0] < g:
            self.rows = torch.empty(g, self.flat.size, device=self.rows.device,
                                    dtype=self.rows.dtype)
            self.grad_rows = torch.empty(g, self.flat.num_params, device=self.rows.device,
                                         dtype=self.rows.dtype)
            self._views = {}
        return self.rows[:g]

    def views(self, a: int) -> RowViews:
        """The views of the first a rows, made once for each a the buffer serves, not at
        every step (each view is an operator the host runs, which on a GPU is what a
        small client's step costs)."""
        if a not in self._views:
            if len(self._views) >= VIEW_SIZES:
                self._views.clear()
            rows = self.rows[:a]
            self._views[a] = RowViews(
                [rows[:, offset:offset + numel] for _, _, offset, numel, _ in self.slots],
                self.named(rows),
                None if self.chain is None else
                group_chain.layer_params(self.chain, rows, self.flat.channels_last))
        return self._views[a]

    def params(self, a: int) -> dict[str, torch.Tensor]:
        """The first a rows' parameters as named views [a, *shape] (NHWC-stored 4-D weights
        as NCHW views with channels-last strides, as FlatModel's)."""
        return self.views(a).named

    def named(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named [a, *shape] views of a [a, >= n] tensor laid out as the rows (parameters,
        or a gradient), NHWC-stored 4-D weights as NCHW views."""
        a, views = rows.shape[0], {}
        for name, shape, offset, numel, nhwc in self.slots:
            piece = rows[:, offset:offset + numel]
            if nhwc:
                o, i, h, w = shape
                views[name] = piece.view(a, o, h, w, i).permute(0, 1, 4, 2, 3)
            else:
                views[name] = piece.view(a, *shape)
        return views

    def gradient(self, a: int, x, y, weights, autocast=None):
        """(per-row loss [a], its gradient: ``grad_rows[:a]``) at the first a rows, for one
        batch per row (x [a, B, ...], y [a, B]; ``weights`` [a, B]: 1/n_real for a row's
        real samples and 0 for padding, None when every batch is full: the plain mean)."""
        losses, pieces = self.gradient_pieces(a, x, y, weights, autocast)
        return losses, self.concatenated(a, pieces)

    def concatenated(self, a: int, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The pieces written into ``grad_rows[:a]`` (one concatenation), returned."""
        torch.cat(pieces, dim=1, out=self.grad_rows[:a])
        return self.grad_rows[:a]

    def by_hand(self, autocast=None) -> bool:
        """Whether a step is ``chain_pieces`` (a chain of plain layers in FP32), not vmap's."""
        return self.chain is not None and autocast is None

    def gradient_pieces(self, a: int, x, y, weights, autocast=None):
        """``gradient`` as one [a, numel] piece per parameter in storage order, not yet
        concatenated: a plain step applies them where they are (``descend_pieces``)."""
        if self.by_hand(autocast):
            return self.chain_pieces(a, x, y, weights)
        if weights is None:
            return self.vmapped(self._grad_mean, a, (x, y), autocast)
        return self.vmapped(self._grad_weighted, a, (x, y, weights), autocast)

    def vmapped(self, step, a: int, args: tuple, autocast=None):
        """(losses [a] detached, pieces) of ``step`` (a ``vmap(grad_and_value(loss))``,
        the loss's first argument a row's named parameters) at the first a rows, with
        ``args`` batched along the rows, under the run's autocast: the default loss's
        gradient, and a hook's own loss (FedRoD's, Per-FedAvg's H v)."""
        with torch.autocast(self.rows.device.type, dtype=autocast, enabled=autocast is not None):
            grads, losses = step(self.params(a), *args)
        return losses.detach(), self.pieces(grads, a)

    def pieces(self, grads: dict[str, torch.Tensor], a: int) -> list[torch.Tensor]:
        """A vmapped gradient's named [a, *shape] tensors as [a, numel] pieces in the flat
        storage order (NHWC-stored 4-D weights permuted back)."""
        return [(grads[name].permute(0, 1, 3, 4, 2) if nhwc else grads[name]).reshape(a, -1)
                for name, _, _, _, nhwc in self.slots]

    def chain_pieces(self, a: int, x, y, weights):
        """``gradient_pieces`` by hand, for a model that is a chain of plain layers
        (``group_chain``): about half the operators of ``vmap(grad)``."""
        return group_chain.chain_pieces(self.chain, self.views(a).layers, x, y, weights,
                                        self.classes, self.flat.channels_last, self.nhwc)

    def inside(self, span: tuple[int, int]) -> list[int]:
        """The slots within the run of coordinates ``span``, found once a span (a step
        takes it from here, not by scanning the layout)."""
        if span not in self._inside:
            self._inside[span] = [i for i, slot in enumerate(self.slots)
                                  if span[0] <= slot[2] < span[1]]
        return self._inside[span]

    def descend_pieces(self, a: int, pieces: list[torch.Tensor], lr, grad_clip: float,
                       span: tuple[int, int] | None = None) -> None:
        """The plain step (no correction, weight decay or momentum) of the first a rows,
        piece by piece: ``group_step``'s result without concatenating the gradient
        (measured: 0.4 ms a step of 50 2NN clients saved). ``span``: only the pieces
        inside this run of coordinates step (and are clipped together)."""
        slices = self.views(a).slices
        if span is not None:
            inside = self.inside(span)
            pieces, slices = [pieces[i] for i in inside], [slices[i] for i in inside]
        scale = lr
        if grad_clip > 0:
            norms = torch.stack([p.pow(2).sum(dim=1) for p in pieces]).sum(dim=0).sqrt_()
            scale = local_sgd.norm_clip_factor(norms, grad_clip).unsqueeze(1) * lr
        for row_piece, piece in zip(slices, pieces):
            _descend(row_piece, piece, scale)


def consecutive(batches, take: int):
    """A group's batches ``take`` at a time: ((x_1, ..), (y_1, ..), (weights_1, ..)) of the
    rows that have all ``take`` of them. A client's last batches short of a whole step
    are dropped, as its stream read ``take`` at a time drops them."""
    it = iter(batches)
    while True:
        part = list(itertools.islice(it, take))
        if len(part) < take:
            return
        a = len(part[-1][1])
        yield (tuple(x[:a] for x, _, _ in part), tuple(y[:a] for _, y, _ in part),
               tuple(None if w is None else w[:a] for _, _, w in part))


def warm_up(flat: FlatModel, autocast=None) -> None:
    """torch.func's first transform costs ~0.65-1 s of lazy imports and registrations
    (measured on a 2-core CPU); a run whose groups use it pays it at setup, not in the
    time of its first round. A chain of plain layers in FP32 never calls it."""
    if group_model(flat).by_hand(autocast):
        return
    step = vmap(grad_and_value(lambda p, x, y: F.cross_entropy(x @ p, y)))
    step(torch.zeros(1, 2, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long))


def group_model(flat: FlatModel) -> GroupModel:
    """The worker's GroupModel of ``flat`` (built once, kept while the model lives)."""
    model = _MODELS.get(flat)
    if model is None:
        model = _MODELS[flat] = GroupModel(flat)
    return model


def group_step(params: torch.Tensor, grads: torch.Tensor, lr, weight_decay: float,
               grad_clip: float, velocity: torch.Tensor | None = None, momentum: float = 0.0,
               nesterov: bool = False) -> None:
    """``local_sgd.sgd_step`` on every row: each client's gradient clipped to its own
    norm; ``lr`` a number or a column [a, 1] of per-client rates."""
    if grad_clip > 0:
        grads.mul_(local_sgd.clip_factor(grads, grad_clip, rows=True))
    if velocity is not None:
        velocity.mul_(momentum).add_(grads)
        if weight_decay:
            velocity.add_(params, alpha=weight_decay)
        if not nesterov:
            _descend(params, velocity, lr)
            return
    if weight_decay:
        params.mul_(1.0 - lr * weight_decay)
    _descend(params, grads, lr)
    if velocity is not None:   # Nesterov's look-ahead term
        _descend(params, velocity, lr * momentum)


def _descend(params: torch.Tensor, direction: torch.Tensor, lr) -> None:
    """params -= lr * direction in one pass (``lr`` a number or a column of rates)."""
    if isinstance(lr, torch.Tensor):
        params.addcmul_(direction, lr, value=-1.0)
    else:
        params.add_(direction, alpha=-lr)


def _learning_rates(ctx: RoundContext, active: int, k: int, schedules: list | None, device):
    """Step k's rate: ctx.lr, one number when the active clients share it, else a column."""
    if schedules is None:
        return ctx.lr
    rates = [s[min(k, len(s) - 1)] for s in schedules[:active]]
    if all(r == rates[0] for r in rates):
        return rates[0]
    return torch.tensor(rates, device=device, dtype=torch.float32).unsqueeze(1)


def train(tasks: list[ClientTask], start: torch.Tensor, ctx: RoundContext,
          correction: GroupCorrection | None = None, gradient: GroupGradient | None = None,
          trainable: tuple[int, int] | None = None, take: int = 1
          ) -> tuple[torch.Tensor, list[float], list[int]]:
    """E local epochs of every client in ``tasks`` (non-increasing step counts) from
    ``start`` ([d], or [G, d] per client). Returns the final rows [G, d] (a view of the
    worker's group buffer: read it before the next group trains), each client's mean
    training loss and step count.

    ``gradient``: the group form of ``local_sgd.train``'s ``gradient_fn`` (SAM's is
    ``sam.group_gradient``), called as ``gradient(model, a, x, y, weights, autocast)``
    with the GroupModel and the step's a active rows, their batches and padding weights
    as ``GroupModel.gradient`` takes them. It returns (losses, grads): each row's batch
    loss [a] at the rows' parameters, detached (what train reports), and the gradient
    to step with [a, n], which the correction, the per-client clipping, weight decay and
    momentum then change in place: ``model.grad_rows[:a]``, as the default leaves it,
    or another tensor of the hook's own. It leaves the parameters ``model.rows[:a]``
    bit for bit as it found them (restore by copy, not by subtraction), may use
    ``grad_rows`` as scratch, and draws any noise from a generator of its own keyed by
    (seed, round, client), never the global one, which the group shares. Without a
    hook, correction, momentum or weight decay a step applies the gradient piece by
    piece (``GroupModel.descend_pieces``). ``trainable``: the run of coordinates the
    steps move, as ``local_sgd.train``'s (clipped, decayed and stepped alone; the other
    gradients are computed and not used). ``take`` > 1: a step takes that many consecutive
    batches of each client's stream (Per-FedAvg's D, D'[, D'']; ``consecutive``), handed
    to ``gradient`` as tuples; a client takes (its batches) // take steps."""
    flat = tasks[0].model
    model = group_model(flat)
    g, n = len(tasks), flat.num_params
    steps = [t.data.num_steps(ctx.local_epochs, ctx.batch_size) // take for t in tasks]
    if any(a < b for a, b in zip(steps, steps[1:])):
        raise ValueError(f"a client group must come in non-increasing step counts, got {steps}")
    rows = model.buffer(g)
    rows.copy_(start.expand(g, -1) if start.dim() == 1 else start)
    params = rows[:, :n]
    lo, hi = trainable or (0, n)
    schedules = None if schedule.constant_within_round(ctx) else \
        [local_sgd.step_lrs(t, ctx) for t in tasks]
    velocity = torch.zeros_like(params) if ctx.momentum else None
    totals = torch.zeros(g, device=rows.device)
    batches = type(tasks[0].data).group_batches([t.data for t in tasks], ctx.local_epochs,
                                               ctx.batch_size) if g else iter(())
    if take > 1:
        batches = consecutive(batches, take)
    autocast = tasks[0].autocast   # bf16 forward and loss, as local_sgd.autocast
    plain = correction is None and gradient is None and not ctx.momentum and not ctx.weight_decay
    gradient = gradient or GroupModel.gradient
    flat.module.train()
    for k, (x, y, weights) in enumerate(batches):
        active = len(y[0] if take > 1 else y)
        lr = _learning_rates(ctx, active, k, schedules, rows.device)
        if plain:
            losses, pieces = model.gradient_pieces(active, x, y, weights, autocast)
            model.descend_pieces(active, pieces, lr, ctx.grad_clip, trainable)
            totals[:active] += losses
            continue
        losses, grads = gradient(model, active, x, y, weights, autocast)
        if correction is not None:
            correction(grads, params[:active])
        group_step(params[:active, lo:hi], grads[:, lo:hi], lr, ctx.weight_decay, ctx.grad_clip,
                   None if velocity is None else velocity[:active, lo:hi], ctx.momentum,
                   ctx.nesterov)
        totals[:active] += losses
    losses = [float(v) / max(s, 1) for v, s in zip(totals.tolist(), steps)]  # host sync: once per group
    return rows, losses, steps


def local_update(tasks: list[ClientTask], x: torch.Tensor, ctx: RoundContext,
                 correction: GroupCorrection | None = None,
                 gradient: GroupGradient | None = None,
                 trainable: tuple[int, int] | None = None, take: int = 1) -> list[Upload]:
    """The group form of ``local_sgd.local_update``: every client from x ([d], or [G, d]:
    a start of its own, a personalised method's merged model), Delta_i = x_K - x_i."""
    rows, losses, steps = train(tasks, x, ctx, correction, gradient, trainable, take)
    return [Upload(delta=rows[i] - (x if x.dim() == 1 else x[i]), num_samples=t.data.num_samples,
                   loss=losses[i], steps=steps[i]) for i, t in enumerate(tasks)]
