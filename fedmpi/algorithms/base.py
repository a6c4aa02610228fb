"""The algorithm protocol: what an FL method fills in; the runtime owns the loop.

A round (fedmpi.runtime: the engine in experiment.py, a phase in phase.py) is one or more
*phases*; each phase is the same pattern::

    server:  participants = phase_participants(state, phase, sampled)
             payload      = payload(state, ctx)                 -> Bcast to workers
    worker:  for each assigned client (state from the client store, if declared):
                 upload = local_update(task, payload, client_state, ctx)
                 sums  += contribution(upload)                  (pre-aggregated per worker)
                 rows  += gather(upload)                        (per client, small)
    server:  sums <- Reduce, rows <- Gatherv, client states <- Gatherv
             server_update(state, sums, rows, ctx)

How each shape of method fits (the next algorithms are written against this):

- extra payload vectors (SCAFFOLD's c, FedCM's momentum, FedACG's lookahead): ``payload``
  returns more named flat tensors; ``traffic`` declares them so the FL ledger counts them.
- per-client persistent state (SCAFFOLD c_i, FedDyn grad_i, MOON previous model):
  ``client_state_sizes`` declares named vectors; the runtime keeps them in a store keyed by
  client id (on the server's host), hands them to whichever rank trains the client and
  takes the new values back, so placement never changes what a client does.
- per-client gathered scalars/vectors (FedNova's a_i, FNR-FL's accuracies and feature
  norms): ``gather_sizes`` declares them; ``server_update`` receives them per client in
  client-id order.
- multi-phase rounds (FNR-FL: train, then refine the worst clients): ``phases`` names
  them; ``phase_participants`` picks who takes part in each from the server state, and
  ``contribution_sizes(d, phase)`` / ``gather_sizes(d, phase)`` say what each sends.
- server state (momentum, Adam moments, control variate c): ``init_server_state`` returns
  named tensors next to the global model ``x``; checkpointing saves the dict as it is.
- client weights that depend on every pair of updates (FedU^2's EUA): the
  ``GramAggregation`` mixin (fedmpi.algorithms.mixins).
- self-supervised methods (no labels, scored by kNN on the encoder): the
  ``SelfSupervised`` mixin (fedmpi.algorithms.mixins).

tests/test_protocol.py exercises all five with a toy algorithm on quadratic clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import torch

from .params import Params


@dataclass(frozen=True)
class RoundContext:
    """Everything a hook may read about the current round; immutable."""

    round: int
    phase: str
    lr: float                 # eta_l^t
    lr_prev: float            # eta_l^{t-1} (= lr / decay), for gradient-unit momentum
    global_lr: float          # eta_g
    weight_decay: float
    grad_clip: float          # 0 = no clipping
    local_epochs: int
    batch_size: int
    num_clients: int          # N
    participants: tuple[int, ...]  # the clients taking part in this phase, ascending
    seed: int
    # The local optimizer (train.*; fedmpi.algorithms.schedule for the local factors):
    momentum: float = 0.0     # heavy-ball momentum, the buffer zeroed per local update
    nesterov: bool = False
    local_schedule: str = "constant"   # constant | step | cosine over the K local steps
    local_decay: float = 1.0  # step: the factor per local epoch
    local_warmup: int = 0     # steps of linear warm-up at the start of each local update
    optimizer: str = "sgd"    # sgd | adam (local_sgd.adam_step; moments zeroed per local update)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8


class ClientData:
    """A client's samples as seen by its local update: an index set into the worker's
    tensors, batched and augmented on the device by the runtime."""

    num_samples: int

    def batches(self, epochs: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def poisson_batches(self, steps: int, rate: float) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` batches, each sample in each independently with probability ``rate``
        (sample-level DP-SGD, fedmpi.runtime.dp_sgd)."""
        raise NotImplementedError

    def view_batches(self, epochs: int, batch_size: int
                     ) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """Self-supervised batches ((view1, view2), y): two random augmentations of each
        image (SimCLR's, ``fedmpi.data.ssl_augment.two_views``), floats in [0, 1]."""
        raise NotImplementedError

    def num_steps(self, epochs: int, batch_size: int) -> int:
        return epochs * -(-self.num_samples // batch_size)

    def label_counts(self, num_classes: int) -> torch.Tensor:
        """How many of the client's samples carry each label, int64 [num_classes] on the
        device of its batches (FedLC's calibration, fedmpi.algorithms.fedlc)."""
        raise NotImplementedError

    @classmethod
    def group_batches(cls, clients: list["ClientData"], epochs: int, batch_size: int
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """A group's batches (``fedmpi.algorithms.group_sgd``; ``clients`` in non-increasing
        step counts): at each step k, (x [a, B, ...], y [a, B], weights [a, B] or None) of
        the a clients with more than k steps, each row the client's own k-th batch. A
        short batch is padded with zero-weight copies of its first sample; ``weights`` is
        1/n_real for real samples and 0 for padding, None when every batch is full."""
        streams = [c.batches(epochs, batch_size) for c in clients]
        for active in active_counts(clients, epochs, batch_size):
            yield stack_batches([next(s) for s in streams[:active]], batch_size)


def active_counts(clients: list[ClientData], epochs: int, batch_size: int) -> list[int]:
    """How many of a group's clients (non-increasing step counts) train at each step."""
    steps = [c.num_steps(epochs, batch_size) for c in clients]
    return [sum(1 for s in steps if s > k) for k in range(steps[0] if steps else 0)]


def stack_batches(batches: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int):
    """(x [a, B, ...], y [a, B], weights [a, B] or None) of one batch per client, short
    batches padded as ``ClientData.group_batches`` says."""
    if all(len(y) == batch_size for _, y in batches):
        return torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches]), None
    xs, ys, ws = [], [], []
    for x, y in batches:
        n = len(y)
        w = torch.zeros(batch_size, device=y.device)
        w[:n] = 1.0 / n
        if n < batch_size:   # (in the batch's own memory layout: channels-last stays so)
            pad = batch_size - n
            layout = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
            x = torch.cat([x, x[:1].expand(pad, *x.shape[1:])]).contiguous(memory_format=layout)
            y = torch.cat([y, y[:1].expand(pad)])
        xs.append(x)
        ys.append(y)
        ws.append(w)
    return torch.stack(xs), torch.stack(ys), torch.stack(ws)


@dataclass
class ClientTask:
    """One client's turn on a worker: its id, its data, and the worker's flat model.

    ``loss_fn(module, x, y)`` is the task's training loss (cross-entropy when None);
    tests give quadratic clients a closed-form loss through it. ``public`` is the
    server-side labelled set (config ``data.public_size``; FNR-FL), None without one.
    ``autocast``: the dtype each training step's forward and loss run in under autocast
    (``system.precision = "bf16"``), None for full precision; the flat parameters, their
    gradients and the update stay FP32 either way. ``private``: with sample-level DP-SGD
    (``privacy.mechanism = "sample"``) the batches and gradient every local SGD step
    takes instead of its own (``local_sgd.train``).
    """

    client: int
    data: ClientData
    model: Any                # fedmpi.flat.FlatModel
    device: torch.device
    loss_fn: Callable | None = None
    public: ClientData | None = None
    autocast: torch.dtype | None = None
    private: Any = None       # sample-level DP-SGD's steps (fedmpi.runtime.dp_sgd), or None


@dataclass
class Upload:
    """What a local update produced. ``delta`` = x_K - x_0 (model space)."""

    delta: torch.Tensor
    num_samples: int
    loss: float
    steps: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, torch.Tensor] | None = None   # new persistent client state


class Algorithm:
    """Base class: FedAvg behaviour in every hook, so a method overrides only what differs.

    Every method opens with the same declaration, a deliberate parallel::

        @register
        class Name(Algorithm):          # or the method it extends, or a mixin first
            name = "..."; paper = "..."
            @dataclass(frozen=True)
            class Params(Params):
                x: float = param(0.1, ">= 0", "what x is")
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    Params: ClassVar[type] = Params
    phases: ClassVar[tuple[str, ...]] = ("train",)
    diagnostic_fields: ClassVar[tuple[str, ...]] = ()   # names ``diagnostics`` returns
    supervised: ClassVar[bool] = True   # False: the ``SelfSupervised`` mixin
    needs_public: ClassVar[bool] = False   # True: refused at config time without data.public_size
    # True: each client has a model of its own (``personal_params``), which per-client
    # evaluation (eval.clients) scores as personal_* (fedmpi.runtime.client_eval)
    personalised: ClassVar[bool] = False
    # Why the method's formulas hold only for SGD local steps (SCAFFOLD's K eta_l), "" when
    # any local optimizer serves: train.optimizer = "adam" is refused at config time with
    # this reason (fedmpi.config.validate), for the method, its subclasses, and a method
    # built over it (FNR-FL's base).
    local_sgd_only: ClassVar[str] = ""
    # False: the layers ``private_layers`` names stay at the initial model's values and
    # need no per-client state (FedBABU's frozen head); True: each client keeps its own
    private_state: ClassVar[bool] = True

    def __init__(self, params: Params | None = None):
        self.params = params if params is not None else self.Params()

    # ---- declarations (sizes in values of the wire dtype, per client) ----
    def traffic(self, d: int, phase: str) -> tuple[int, int]:
        """(values downloaded, values uploaded) by one participating client in ``phase``."""
        return d, d

    def client_state_sizes(self, d: int) -> dict[str, int]:
        return {}

    def compressible(self, d: int) -> dict[str, dict[str, int]]:
        """The messages a codec may compress (``[compression]``), by name and size:
        "up", vectors of the upload (``delta`` or a name in ``extras``); "down", vectors
        of the payload. Whatever else ``traffic`` counts (a scalar such as FedNova's a_i)
        is sent at full width."""
        return {"up": {"delta": d}, "down": {"x": d}}

    def gather_sizes(self, d: int, phase: str | None = None) -> dict[str, int]:
        """Per-client values ``gather`` returns in ``phase``; None: in any phase (the
        union, a key missing from ``gather`` in a phase is NaN there)."""
        return {}

    def recorded_gather(self, d: int) -> dict[str, int]:
        """The gathered values the results file keeps, one /clients column per value: all
        of ``gather_sizes`` by default. A method that gathers large vectors only for the
        server's use (Orchestra's m x p local centroids) leaves them out, so a client row
        stays a few columns wide; the server still receives them."""
        return self.gather_sizes(d)

    def contribution_sizes(self, d: int, phase: str | None = None) -> dict[str, int]:
        """Vectors ``contribution`` returns in ``phase``, summed over the clients; None: in
        any phase (the union, zero-filled where a phase has none)."""
        return {"delta": d, "weight": 1}

    def build_model(self, build, name: str, in_channels: int, num_classes: int, image_size: int,
                    options: dict):
        """The nn.Module this method trains; ``build`` is the model registry's
        ``build_model`` (the ``SelfSupervised`` mixin wraps the backbone in its heads)."""
        return build(name, in_channels, num_classes, image_size, **options)

    def check_model(self, model_options: dict) -> None:
        """Config-time check that the model has what this method needs (MOON: a
        projection head); raise UsageError naming the model.<option>."""

    def check_training(self, train) -> None:
        """Config-time check that the local optimizer (``train``, a TrainConfig) is one this
        method's formulas hold for (SCAFFOLD's K eta_l needs a constant local lr); raise
        UsageError naming the train.<field>."""

    def effective_weight_decay(self, weight_decay: float) -> float:
        """The decay per unit of gradient that ``train.weight_decay`` = lambda amounts to
        once the method's own dynamics are at their fixed point: lambda for every method
        whose step is SGD's g + lambda w; a method that mixes a server direction carrying
        last round's decay into its steps (client momentum) says otherwise. The results
        file records it (root attribute ``effective_weight_decay``), so two runs whose
        equal ``train.weight_decay`` means different decays are seen to differ."""
        return weight_decay

    # ---- server side ----
    def init_server_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x.clone()}

    def phase_participants(self, state, phase: str, sampled: np.ndarray) -> np.ndarray:
        return sampled

    def payload(self, state, ctx: RoundContext) -> dict[str, torch.Tensor]:
        return {"x": state["x"]}

    def server_update(self, state, sums: dict[str, torch.Tensor],
                      gathered: dict[str, np.ndarray], ctx: RoundContext) -> None:
        """x <- x + eta_g * sum_i w_i Delta_i / sum_i w_i, w_i = n_i (``contribution``) or
        1 (``server_opt.count_once``, the plain mean)."""
        # host sync: server, once per round
        state["x"].add_(sums["delta"], alpha=ctx.global_lr / float(sums["weight"]))

    def gram_weighted(self, phase: str) -> bool:
        """True in a phase whose ``delta`` the runtime sums with pairwise weights: the
        ``GramAggregation`` mixin."""
        return False

    def personal_params(self, client_state, x: torch.Tensor) -> torch.Tensor:
        """A client's personalised model (flat, storage order) from its state (this
        algorithm's entries, on the device; zeros for a client never trained) and ``x``,
        the global model ``eval_params`` gives; only for ``personalised`` methods."""
        return x

    def private_layers(self, module) -> list[str]:
        """The layers of ``module`` (module names) that never travel: each client keeps
        its own (fedmpi.runtime.partial), the payload and the upload carry only the
        others. Only for a method with FedAvg's server side (``fedavg_server_side``)."""
        return []

    def eval_params(self, state) -> torch.Tensor:
        return state["x"]

    def diagnostics(self, state, sums, gathered, ctx) -> dict[str, float]:
        """The algorithm's own per-round signals (FedExP's step, FedMRUR's distance, ...),
        called after ``server_update`` of each phase; keys from ``diagnostic_fields``.
        They land in /rounds of the results file."""
        return {}

    # ---- client side ----
    def local_update(self, task: ClientTask, payload, client_state, ctx: RoundContext) -> Upload:
        raise NotImplementedError

    def local_update_group(self, tasks: list[ClientTask], payload, client_states: list,
                           ctx: RoundContext) -> list[Upload]:
        """The local updates of a group of clients in lock-step (``system.client_group``,
        fedmpi.algorithms.group_sgd): ``tasks`` come in non-increasing step count, their
        states in the same order; returns one Upload per task, each what ``local_update``
        would return (up to float rounding). A method that defines it trains in groups."""
        raise NotImplementedError

    @classmethod
    def trains_in_groups(cls) -> bool:
        """Whether ``local_update_group`` serves this class: it must be defined at or
        below the class that defines ``local_update``, so a method that changes its local
        update without a group form of the change is refused, not silently wrong."""
        def owner(name: str) -> type:
            return next(k for k in cls.__mro__ if name in vars(k))
        group = owner("local_update_group")
        return group is not Algorithm and issubclass(group, owner("local_update"))

    def contribution(self, upload: Upload) -> dict[str, torch.Tensor]:
        n = float(upload.num_samples)
        return {"delta": upload.delta * n,
                "weight": torch.tensor([n], dtype=upload.delta.dtype, device=upload.delta.device)}

    def gather(self, upload: Upload) -> dict[str, torch.Tensor]:
        return {}

    def refined_upload(self, upload: Upload, x: torch.Tensor | None, w: torch.Tensor,
                       w_new: torch.Tensor, steps: int, ctx: RoundContext
                       ) -> tuple[Upload, dict[str, torch.Tensor]]:
        """FNR-FL's refinement (fedmpi.algorithms.fnrfl), on the client: this method's local
        update of the round went from x (x^t; None where not known) to w and sent
        ``upload``, as the client rebuilds it (delta = w - x, num_samples, the extras of the
        names ``gather_sizes`` and ``contribution_sizes`` declare, the client state after it
        as ``state``; loss and steps not kept); it goes on to w_new by ``steps`` plain SGD
        steps of ``ctx``'s local optimizer. Returns the upload it would have sent ending at
        w_new (its ``gather`` values and ``state`` become the client's; ``state`` is
        ``upload.state`` where nothing changes), and how this client's ``contribution``
        changes: {name: new - old} for the one vector that changes, "delta" or the method's
        only one besides "weight".
        Default (a contribution linear in delta, nothing else depending on w): delta =
        w_new - x, and "delta" changes by the contribution of w_new - w."""
        change = self.contribution(replace(upload, delta=w_new - w))["delta"]
        return replace(upload, delta=None if x is None else w_new - x), {"delta": change}


REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an algorithm selectable by ``algorithm.name``."""
    REGISTRY[cls.name] = cls
    return cls


# the hooks of FedAvg's server side: one phase, the model as the payload, the sample-
# weighted mean of the deltas, no server state; a method that overrides none of them keeps
# FedAvg's server (its local update is its own), which asynchronous FL and user-level DP
# replace or wrap (fedmpi.runtime.participation, fedmpi.runtime.dp)
FEDAVG_SERVER = ("init_server_state", "payload", "server_update", "contribution",
                 "contribution_sizes", "phase_participants", "gram_weighted", "traffic")


def keeps_private_layers(kind: type) -> bool:
    """Whether algorithm class ``kind`` keeps layers on its clients (``private_layers``)."""
    return kind.private_layers is not Algorithm.private_layers


def fedavg_server_side(kind: type) -> bool:
    """Whether algorithm class ``kind`` has FedAvg's server side (``FEDAVG_SERVER``)."""
    return len(kind.phases) == 1 and all(getattr(kind, h) is getattr(Algorithm, h)
                                         for h in FEDAVG_SERVER)

