"""Client groups (system.client_group): G clients of a worker trained in lock-step as one
computation (fedmpi.algorithms.group_sgd) give each client what the sequential path
gives it, up to float rounding, for every algorithm with a group form; the groups are a
function of the participants alone, so deterministic runs are bitwise the same for any
number of ranks; everything else is refused at config time with one line."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fedmpi import algorithms
from fedmpi import config as cfg
from fedmpi.algorithms import ClientTask, RoundContext, group_sgd
from fedmpi.algorithms.base import ClientData
from fedmpi.comm import LocalComm
from fedmpi.data.augment import ClientSkew
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model, group_problem
from fedmpi.models.classifier import Classifier
from fedmpi.models.mlp import TwoNN
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.clientdata import DeviceData, TensorClientData
from fedmpi.runtime.plan import group_size, groups, place

from conftest import fedmpi, needs_mpi, run_on_ranks
from helpers import TINY, merged, write_config

GROUPED = sorted(n for n, c in algorithms.REGISTRY.items() if c.trains_in_groups())
# float rounding of batched kernels against one client's: a few ulps of the weights per step
TOL = dict(rtol=1e-4, atol=1e-5)

# TINY's CNN (unpadded, and padded as the paper's) and the 2NN train by their
# hand-written gradients; a projection head makes the CNN no chain of plain layers, so
# torch.func.vmap differentiates it
GROUP_FORMS = [None, {**TINY["model"], "proj_dim": 4}, {"name": "2nn", "hidden": [16]},
               {**TINY["model"], "padding": "same"}]


class Samples(ClientData):
    """A client's own samples in a keyed random order each epoch (as the runtime's data)."""

    def __init__(self, x, y, key):
        self.x, self.y, self.key, self.num_samples = x, y, key, len(y)

    def batches(self, epochs, batch_size):
        g = torch.Generator().manual_seed(self.key)
        for _ in range(epochs):
            order = torch.randperm(self.num_samples, generator=g)
            for s in range(0, self.num_samples, batch_size):
                idx = order[s:s + batch_size]
                yield self.x[idx], self.y[idx]

    def label_counts(self, num_classes):
        return torch.bincount(self.y, minlength=num_classes)


def clients(sizes, seed=0, side=16):
    g = torch.Generator().manual_seed(seed)
    return [Samples(torch.randn(n, 1, side, side, generator=g),
                    torch.randint(0, 4, (n,), generator=g), 100 + i) for i, n in enumerate(sizes)]


def context(**over):
    base = dict(round=1, phase="train", lr=0.05, lr_prev=0.05, global_lr=1.0, weight_decay=0.0,
                grad_clip=0.0, local_epochs=2, batch_size=4, num_clients=10,
                participants=tuple(range(4)), seed=0)
    return RoundContext(**{**base, **over})


def flat_model(name="cnn", channels_last=False, device="cpu", alg=None):
    """A small model by name; "cnn-same" is the CNN with padded convolutions (the paper's
    network, ``model.padding = "same"``); "cnn-vmap" is the CNN with its chain set aside,
    so a group differentiates it by torch.func.vmap, not group_chain."""
    torch.manual_seed(0)
    base = name.removesuffix("-vmap")
    options = {"hidden": [12]}
    if base.startswith("cnn"):
        options = {"hidden": 16, "channels": [3, 4]}
        if base == "cnn-same":
            base, options["padding"] = "cnn", "same"
    module = alg.build_model(build_model, base, 1, 4, 16, options) if alg is not None \
        else build_model(base, 1, 4, 16, **options)   # the method's (FedRoD's second head)
    flat = FlatModel(module, device, channels_last=channels_last)
    if name.endswith("-vmap"):
        group_sgd.group_model(flat).chain = None
    return flat


def state_of(alg, d, i):
    g = torch.Generator().manual_seed(7 + i)
    return {k: 0.01 * torch.randn(n, generator=g) for k, n in alg.client_state_sizes(d).items()}


def payload_of(alg, flat, ctx):
    state = alg.init_server_state(flat.params.detach().clone())
    for k, v in state.items():   # a server state with some history: momenta, c, h not zero
        if k != "x" and v.is_floating_point() and v.numel() == flat.size:
            v.copy_(0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3)))
    return alg.payload(state, ctx)


def both_paths(name, ctx, sizes=(9, 9, 6, 3), model="cnn", channels_last=False, params=None,
               states=None):
    """Sequential uploads and group uploads of the same clients (sizes non-increasing);
    ``states(alg, flat, x)``: the clients' states (``state_of``'s by default)."""
    alg = algorithms.build(name, params or {})
    flat = flat_model(model, channels_last, alg=alg)
    data = clients(sizes)
    tasks = [ClientTask(client=i, data=dt, model=flat, device=torch.device("cpu"))
             for i, dt in enumerate(data)]
    payload = payload_of(alg, flat, ctx)
    states = states(alg, flat, payload["x"]) if states else \
        [state_of(alg, flat.size, i) or None for i in range(len(tasks))]
    one = [alg.local_update(t, payload, s, ctx) for t, s in zip(tasks, states)]
    group = alg.local_update_group(tasks, payload, states, ctx)
    return alg, one, group


def assert_same_uploads(alg, one, group):
    assert len(one) == len(group)
    for a, b in zip(one, group):
        assert (a.steps, a.num_samples) == (b.steps, b.num_samples)
        torch.testing.assert_close(b.delta, a.delta, **TOL)
        assert b.loss == pytest.approx(a.loss, rel=1e-4)
        ca, cb = alg.contribution(a), alg.contribution(b)
        assert ca.keys() == cb.keys()
        for k in ca:
            torch.testing.assert_close(cb[k], ca[k], **TOL)
        ga, gb = alg.gather(a), alg.gather(b)
        for k in ga:
            torch.testing.assert_close(gb[k], ga[k], **TOL)
        assert (a.state is None) == (b.state is None)
        for k in (a.state or {}):
            torch.testing.assert_close(b.state[k], a.state[k], **TOL)


def test_every_method_with_a_local_sgd_update_trains_in_groups():
    """Every method whose client runs the shared local SGD step has a group form; the
    ones that train something else (self-supervised heads, MOON's models, FedMIM's
    inertia, FedMRUR's regulariser, FNR-FL's refinement) are refused, not served wrongly."""
    assert GROUPED == ["apfl", "ditto", "fedacg", "fedadam", "fedala", "fedavg", "fedavgm",
                       "fedbabu", "fedbn", "fedcm", "feddyn", "fedexp", "fednova", "fedper",
                       "fedprox", "fedrep", "fedrod", "fedsam", "lg_fedavg", "mofedsam",
                       "perfedavg", "pfedme", "scaffold"]


@pytest.mark.parametrize("model", ["cnn", "cnn-same", "cnn-vmap", "2nn"])
@pytest.mark.parametrize("name", GROUPED)
def test_group_form_equals_the_sequential_local_update(name, model):
    """Unequal clients (two full, one with a short last batch, one with fewer steps): each
    client's delta, loss, steps, contribution, gathered values and new state; for the
    CNN (unpadded, and padded as the paper's), the 2NN (their hand-written gradients) and
    the CNN under torch.func.vmap (as a model that is no chain of plain layers trains)."""
    assert_same_uploads(*both_paths(name, context(grad_clip=1.0), model=model))


@pytest.mark.parametrize("started", [1.0, 2.0])
def test_fedala_in_groups_aggregates_each_client_as_it_does_alone(started):
    """Clients with a local model (second participation: W trained until its losses
    settle; later ones: one pass): each client's theta_hat on its own, then the rows in
    lock-step, as one client after another."""
    def states(alg, flat, x):
        out = []
        for i in range(4):
            g = torch.Generator().manual_seed(11 + i)
            out.append({"theta": x + 0.05 * torch.randn(x.shape, generator=g),
                        "weights": torch.rand(x.shape, generator=g),
                        "started": torch.full((1,), started)})
        return out
    assert_same_uploads(*both_paths("fedala", context(), states=states,
                                    params={"max_passes": 3, "threshold": 1e-9}))


@pytest.mark.parametrize("model", ["cnn", "cnn-vmap", "2nn"])
@pytest.mark.parametrize("sizes", [(9, 9, 6, 3), (13, 9, 8, 5)])
def test_per_fedavg_hessian_free_in_groups(model, sizes):
    """Per-FedAvg's Hessian-free meta-steps (three consecutive batches a step, H v under
    vmap) as one client after another; the clients' batch counts leave 0-2 batches over
    (dropped), and short last batches are padded."""
    assert_same_uploads(*both_paths("perfedavg", context(grad_clip=1.0), sizes=sizes,
                                    model=model, params={"variant": "hf", "alpha": 0.05}))


def test_the_padded_cnn_trains_in_groups_by_its_hand_written_gradient():
    """model.padding = "same" keeps the CNN a chain of plain layers: its convolutions
    carry padding 2, which group_chain reads into the grouped convolution and its
    backward (the sequential comparison above would fail without it: other shapes)."""
    model = group_sgd.group_model(flat_model("cnn-same"))
    convs = [layer for layer in model.chain if layer.kind == "conv"]
    assert kinds(model.chain) == CNN_KINDS
    assert [layer.options[1] for layer in convs] == [(2, 2), (2, 2)]
    assert [layer.options[1] for layer in group_sgd.group_model(flat_model("cnn")).chain
            if layer.kind == "conv"] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("over", [
    dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(weight_decay=1e-3),
    dict(local_schedule="step", local_decay=0.5), dict(local_schedule="cosine", local_warmup=2),
    dict(grad_clip=0.05)])
@pytest.mark.parametrize("model", ["cnn", "2nn"])
def test_local_optimizer_in_groups(over, model):
    """Momentum, Nesterov, weight decay, per-client clipping and local schedules (whose
    per-step rates differ between clients of unequal epochs) follow sgd_step row by row."""
    assert_same_uploads(*both_paths("fedavg", context(**over), model=model))


@pytest.mark.parametrize("name,params", [("fednova", {"rho": 0.5}), ("fednova", {"mu": 0.1}),
                                         ("fedsam", {"rho": 0.0})])
def test_group_corrections_with_their_own_state(name, params):
    """FedNova's heavy ball keeps one velocity per client; SAM with rho 0 is one pass."""
    assert_same_uploads(*both_paths(name, context(), params=params))


@pytest.mark.parametrize("model,channels_last", [("cnn", True), ("cnn-same", True),
                                                  ("cnn-vmap", True), ("2nn", False)])
def test_group_form_for_the_models_and_layouts(model, channels_last):
    assert_same_uploads(*both_paths("fedprox", context(), model=model,
                                    channels_last=channels_last))


class Wider(TwoNN):
    """A 2NN whose features are not its layers' chain: no hand-written gradient for it."""

    def features(self, x):
        return 2 * super().features(x)


class Chained(Classifier):
    """A model whose forward is its ``body`` then its ``classifier``, and says so."""

    def features(self, x):
        return self.body(x)

    def chain(self):
        return list(self.body) + [self.classifier]


class Strided(Chained):
    """A chain with what the McMahan CNN lacks: strides, padding, dilation, a pool with
    its own stride, padding and ceil_mode, no ReLU before one pool, three channels."""

    def __init__(self, conv=None, pool=None):
        super().__init__()
        self.body = nn.Sequential(
            conv or nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(),
            pool or nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
            nn.Conv2d(4, 5, 3, padding=2, dilation=2), nn.MaxPool2d(2), nn.ReLU(),
            nn.Flatten(), nn.Linear(20, 6), nn.ReLU())
        self.classifier = nn.Linear(6, 4)


class Foreign(Strided):
    """A chain() naming a layer that is not the model's own: no hand-written gradient."""

    def chain(self):
        return super().chain()[:-1] + [nn.Linear(6, 4)]


class Standardized(nn.Conv2d):
    """A Conv2d whose forward is its own (weight standardisation): no hand-written
    gradient for a chain holding it."""

    def forward(self, x):
        w = self.weight
        return self._conv_forward(x, (w - w.mean()) / (w.std() + 1e-5), self.bias)


class Flattened(Chained):
    """The input flattened twice (a no-op the second time), then a Linear-ReLU chain."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Flatten(), nn.Linear(108, 5), nn.ReLU())
        self.classifier = nn.Linear(5, 4)


def kinds(chain):
    return None if chain is None else " ".join(layer.kind for layer in chain)


CNN_KINDS = "conv pool relu conv pool relu flatten linear relu linear"


@pytest.mark.parametrize("build,shape,expected", [
    (lambda: build_model("2nn", 3, 4, 6, hidden=[12]), (3, 6, 6), "linear relu linear"),
    (lambda: build_model("mlp", 7, 4, 1, hidden=[]), (7,), "linear"),
    (lambda: build_model("mlp", 7, 4, 1, hidden=[5, 6, 3]), (7,),
     "linear relu linear relu linear relu linear"),
    (lambda: build_model("mlp", 7, 4, 1, hidden=[5], proj_dim=3), (7,), None),
    (lambda: Wider(1, 4, 6, hidden=(5,)), (1, 6, 6), None),
    (lambda: build_model("cnn", 1, 4, 16, hidden=16, channels=[3, 4]), (1, 16, 16), CNN_KINDS),
    (lambda: build_model("cnn", 3, 4, 16, hidden=16, channels=[3, 4]), (3, 16, 16), CNN_KINDS),
    (lambda: build_model("cnn", 3, 4, 16, hidden=16, channels=[3, 4], padding="same"),
     (3, 16, 16), CNN_KINDS),
    (lambda: build_model("cnn", 1, 4, 16, hidden=16, channels=[3, 4], proj_dim=3), (1, 16, 16),
     None),
    (lambda: Strided(), (3, 16, 16), "conv pool relu conv pool relu flatten linear relu linear"),
    (lambda: Strided(conv=nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False)), (3, 16, 16),
     None),
    (lambda: Strided(conv=nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect")),
     (3, 16, 16), None),
    (lambda: Strided(conv=nn.Conv2d(3, 4, 3, padding="valid")), (3, 16, 16), None),
    (lambda: Strided(pool=nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True)), (3, 16, 16),
     None),
    (lambda: Foreign(), (3, 16, 16), None),
    (lambda: Strided(conv=Standardized(3, 4, 3, stride=2, padding=1)), (3, 16, 16), None),
    (lambda: Flattened(), (3, 6, 6), "linear relu linear")])
@pytest.mark.parametrize("channels_last,nhwc", [(False, False), (True, True), (True, False)])
def test_a_chain_of_plain_layers_has_a_hand_written_gradient_equal_to_vmaps(
        build, shape, expected, channels_last, nhwc):
    """Where the model is a chain of biased convolutions, ReLU, max-pooling, Flatten and
    Linear layers holding all its parameters (the CNN, the 2NN, the tabular MLP), a group
    differentiates it by hand; its losses and gradient pieces are vmap(grad)'s up to
    rounding: mean and weighted losses (padding weighs 0), all rows and a prefix, both
    weight layouts, channels-last weights with channels-last or (as on a GPU) NCHW
    activations. Other models (a projection head, an overridden forward, a bias-free,
    reflect-padded or string-padded convolution, a Conv2d subclass with its own forward,
    average pooling, a chain naming a layer the model does not hold) keep vmap."""
    torch.manual_seed(0)
    module = build()
    model = group_sgd.GroupModel(FlatModel(module, channels_last=channels_last))
    assert model.nhwc == channels_last   # on a CPU
    model.nhwc = nhwc
    chain = model.chain
    assert kinds(chain) == expected
    if chain is None:
        return
    g, b = 5, 4
    model.buffer(g).copy_(model.flat.params + 0.3 * torch.randn(g, model.flat.size))
    x, y = torch.randn(g, b, *shape), torch.randint(0, 4, (g, b))
    weights = torch.rand(g, b)
    weights[:, -1] = 0.0
    for a in (g, 2, 1):
        for w in (None, weights[:a]):
            losses, pieces = model.chain_pieces(a, x[:a], y[:a], w)
            model.chain = None
            want_losses, want = model.gradient_pieces(a, x[:a], y[:a], w)
            model.chain = chain
            torch.testing.assert_close(losses, want_losses)
            assert [p.shape for p in pieces] == [p.shape for p in want]
            for p, q in zip(pieces, want):
                torch.testing.assert_close(p, q)
            assert max(p.abs().max() for p in pieces) > 0
    if len(shape) == 3:   # images stored channels-last (augmented, stacked batches): same bits
        strided = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
        for p, q in zip(model.chain_pieces(g, strided, y, None)[1],
                        model.chain_pieces(g, x, y, None)[1]):
            assert torch.equal(p, q)
    # bf16 autocast keeps vmap: the chain's FP32 products would not be the bf16 step's
    autocast, fp32 = (model.gradient_pieces(g, x, y, None, torch.bfloat16),
                      model.chain_pieces(g, x, y, None))
    model.chain = None
    vmapped = model.gradient_pieces(g, x, y, None, torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(autocast[1], vmapped[1]))
    assert not torch.equal(autocast[0], fp32[0])


def test_a_chains_layers_point_at_their_parameters_in_storage_order():
    module = build_model("2nn", 3, 4, 6, hidden=[12])
    chain = group_sgd.GroupModel(FlatModel(module)).chain
    assert [(c.weight, c.shape, c.bias) for c in chain if c.kind == "linear"] == \
        [(0, (12, 108), 1296), (1308, (4, 12), 1356)]


def test_a_groups_parameter_views_follow_its_buffer():
    """The views a step takes are made once for each group size and are views of the
    current rows: a grown buffer makes them anew, and at most VIEW_SIZES sizes are kept."""
    model = group_sgd.GroupModel(flat_model("cnn"))
    rows = model.buffer(3)
    slices, named, layers = model.views(2)
    assert model.views(2)[0] is slices
    rows[1].fill_(0.5)
    assert torch.all(slices[0][1] == 0.5) and torch.all(layers[0][0][1] == 0.5)
    rows = model.buffer(5)   # grown: a new buffer
    assert model.views(2)[0] is not slices
    assert model.views(2)[0][0].data_ptr() == rows.data_ptr()
    for a in range(1, group_sgd.VIEW_SIZES + 3):
        model.buffer(a)
        model.views(a)
    assert len(model._views) <= group_sgd.VIEW_SIZES


def test_max_pooling_first_is_relu_then_max_pooling_bit_for_bit():
    """The chain pools before a ReLU that precedes the pool: the maximum commutes with
    the ReLU, ties and all (exact zeros from the ReLU, equal values), so the values and
    the gradient are the same bits as the model's order."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 9, 9).round_(decimals=1)   # many ties
    g = torch.randn(3, 4, 4, 4)
    pool = nn.MaxPool2d(2)
    grads = []
    for order in ((nn.ReLU(), pool), (pool, nn.ReLU())):
        v = x.clone().requires_grad_()
        out = nn.Sequential(*order)(v)
        out.backward(g)
        grads.append((out.detach(), v.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


GROUP_BATCH_CASES = [
    ("image", False, None, True, "train"), ("image", False, None, False, "test"),
    ("image", True, None, True, "train"), ("image", False, ClientSkew(noise_std=0.1), True,
                                           "train"),
    ("image", False, ClientSkew(brightness=0.5), False, "train"),
    ("gray", False, None, True, "train"),
    ("text", True, None, False, "train"), ("tabular", False, None, False, "train")]


@pytest.mark.parametrize("modality,augment,skew,channels_last,split", GROUP_BATCH_CASES)
def test_a_groups_batches_are_its_clients_own_bit_for_bit(modality, augment, skew,
                                                         channels_last, split):
    """The runtime's group batches (one gather a step, or each client's stream where the
    conversion draws randomness) against each client's own ``batches`` stacked: the same
    steps, values, memory layout and padding weights, for short, whole and empty clients
    over two epochs."""
    check_group_batches(torch.device("cpu"), modality, augment, skew, channels_last, split)


def check_group_batches(device, modality, augment, skew, channels_last, split):
    g = torch.Generator().manual_seed(3)
    shape = {"image": (3, 6, 6), "gray": (1, 5, 5), "text": (7,), "tabular": (5,)}[modality]
    modality = "image" if modality == "gray" else modality
    x = torch.randint(0, 256, (130, *shape), generator=g, dtype=torch.uint8)
    if modality == "tabular":
        x = x.float()
    dataset = SimpleNamespace(train_x=x, train_y=torch.randint(0, 10, (130,), generator=g),
                              test_x=x.flip(0), test_y=torch.arange(130), modality=modality,
                              mean=(0.5, 0.4, 0.3)[:shape[0]], std=(0.2, 0.3, 0.25)[:shape[0]])
    data = DeviceData(dataset, device, augment=augment, crop_padding=2, flip=True,
                      channels_last=channels_last)
    sizes = [37, 30, 21, 20, 10, 7, 1, 0]
    group = [data.client(np.arange(sum(sizes[:i]), sum(sizes[:i + 1])), 5, 2, 40 + i, 0,
                         split=split, skew=skew) for i in range(len(sizes))]
    got = list(TensorClientData.group_batches(group, 2, 10))
    want = list(ClientData.group_batches(
        [data.client(c.indices.numpy(), 5, 2, 40 + i, 0, split=split, skew=skew)
         for i, c in enumerate(group)], 2, 10))
    assert len(got) == len(want) == 8
    for (x1, y1, w1), (x2, y2, w2) in zip(got, want):
        assert x1.device.type == device.type
        assert x1.shape == x2.shape and x1.stride() == x2.stride()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert (w1 is None) == (w2 is None) and (w1 is None or torch.equal(w1, w2))
    assert [len(y) for _, y, _ in got] == [7, 7, 4, 4, 3, 3, 1, 1]


@pytest.mark.parametrize("modality,augment,skew,channels_last,split", GROUP_BATCH_CASES)
@pytest.mark.parametrize("gather_bytes", [1, 3 * 10 * 108, 8 << 20])
def test_a_clients_batches_gathered_in_spans_are_its_batches(monkeypatch, modality, augment,
                                                            skew, channels_last, split,
                                                            gather_bytes):
    """``batches`` gathers up to GATHER_BYTES of batches with one index and slices them:
    the same batches, bit for bit and in the same layout, as a gather per batch, whether
    a span is one batch, three, or the whole epoch (a client of 37 over two epochs)."""
    from fedmpi.runtime import clientdata

    monkeypatch.setattr(clientdata, "GATHER_BYTES", gather_bytes)
    g = torch.Generator().manual_seed(3)
    shape = {"image": (3, 6, 6), "gray": (1, 6, 6), "text": (7,), "tabular": (5,)}[modality]
    x = torch.randint(0, 256, (130, *shape), generator=g, dtype=torch.uint8)
    if modality == "tabular":
        x = x.float()
    dataset = SimpleNamespace(train_x=x, train_y=torch.randint(0, 10, (130,), generator=g),
                              test_x=x.flip(0), test_y=torch.arange(130),
                              modality="image" if modality == "gray" else modality,
                              mean=(0.5, 0.4, 0.3)[:shape[0]], std=(0.2, 0.3, 0.25)[:shape[0]])
    data = DeviceData(dataset, torch.device("cpu"), augment=augment, crop_padding=2, flip=True,
                      channels_last=channels_last)
    client = data.client(np.arange(40, 77), 5, 2, 9, 0, split=split, skew=skew)
    got = list(client.batches(2, 10))
    again = data.client(np.arange(40, 77), 5, 2, 9, 0, split=split, skew=skew)
    want = [(data.prepare(again.x[b], aug, skew, None), again.y[b])
            for b, aug in again._index_batches(2, 10)]
    assert [len(y) for _, y in got] == [10, 10, 10, 7] * 2
    for (x1, y1), (x2, y2) in zip(got, want, strict=True):
        assert x1.stride() == x2.stride() and torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_group_of_one_and_equal_clients():
    assert_same_uploads(*both_paths("fedavg", context(), sizes=(5,)))
    assert_same_uploads(*both_paths("fedavg", context(), sizes=(8, 8, 8)))


def test_a_group_must_come_in_non_increasing_steps():
    with pytest.raises(ValueError, match="non-increasing"):
        both_paths("fedavg", context(), sizes=(3, 9))


# ---- groups and their placement ---------------------------------------------------------

def test_groups_are_runs_of_the_participants_by_steps_and_placed_whole():
    steps = np.array([3, 5, 5, 1, 2, 5, 4, 2])
    assert [g.tolist() for g in groups(np.array([0, 1, 2, 3, 4, 5, 6, 7]), steps, 3)] == \
        [[1, 2, 5], [6, 0, 4], [7, 3]]
    for workers in (1, 2, 3, 4):
        placed = place(np.arange(8), steps, workers, group=3)
        assert sorted(np.concatenate(placed).tolist()) == list(range(8))
        for unit in groups(np.arange(8), steps, 3):   # every group on exactly one worker
            assert sum(set(unit.tolist()) <= set(p.tolist()) for p in placed) == 1
    # group 1 is the client-by-client placement it always was
    assert [p.tolist() for p in place(np.arange(8), steps, 3)] == \
        [p.tolist() for p in place(np.arange(8), steps, 3, group=1)]


def test_auto_group_size_fits_memory_and_leaves_each_worker_a_group():
    d = 200_000
    assert group_size(7, d, 50, 2, 0) == 7
    assert group_size("auto", d, 50, 1, 1 << 30) == 50
    assert group_size("auto", d, 50, 2, 1 << 30) == 25
    assert group_size("auto", d, 50, 1, 6 * 4 * d * 10) == 10
    assert group_size("auto", d, 50, 1, 0) == 1
    # convolutions on a CPU: the sequential path is the faster one (benchmarks/cross_device.py)
    assert group_size("auto", d, 50, 1, 1 << 30, sequential_faster=True) == 1
    assert group_size(8, d, 50, 1, 1 << 30, sequential_faster=True) == 8


# ---- through the runtime ------------------------------------------------------------------

def run_tiny(tmp_path, name, **over):
    values = merged(TINY, **over)
    if "name" in over.get("model", {}):   # another model: none of TINY's cnn options
        values["model"] = dict(over["model"])
    values["output"] = str(tmp_path / f"{name}.h5")
    c = cfg.from_dict(values)
    run_experiment(c, LocalComm(), quiet=True)
    return RunFile(c.output_path())


@pytest.mark.parametrize("model,threads,algorithm,expected", [
    ("2nn", 2, "fedavg", 5), ("2nn", 1, "fedavg", 1), ("cnn", 2, "fedavg", 5),
    ("cnn", 1, "fedavg", 1), ("cnn-vmap", 2, "fedavg", 1), ("2nn", 2, "fedmim", 1)])
def test_deterministic_auto_follows_the_rule(tmp_path, model, threads, algorithm, expected):
    """A deterministic run does not time (its bits would follow the timing): on CPU
    workers "auto" groups only with more than one thread and where no convolution is left
    to vmap (benchmarks/cross_device.py): the CNN's hand-written gradient groups, the CNN
    with a projection head (vmap) does not; and only methods with a group form; the file
    says what it chose and holds no probe."""
    models = {"2nn": {"name": "2nn", "hidden": [16]}, "cnn": {}, "cnn-vmap": GROUP_FORMS[1]}
    with run_tiny(tmp_path, "auto", rounds=1, model=models[model],
                  algorithm={"name": algorithm},
                  system={"threads": threads, "client_group": "auto",
                          "deterministic": True}) as run:
        assert run.attrs["client_group"] == expected
        assert "client_group_probe" not in run.attrs


@pytest.mark.parametrize("times,expected", [((1.0, 0.5), 5), ((1.0, 0.99), 1), ((1.0, 2.0), 1)])
def test_auto_chooses_what_the_probe_timed_faster(tmp_path, monkeypatch, times, expected):
    """Not deterministic, on a CPU: "auto" groups only when the group step was timed at
    least PROBE_MARGIN (5%) faster than the same clients one by one, and the file records
    both times and the choice."""
    from fedmpi.runtime import grouping

    calls = []
    monkeypatch.setattr(grouping, "probe", lambda flat, g, *a, **k: calls.append(g) or times)
    with run_tiny(tmp_path, "auto", rounds=1, model={"name": "2nn", "hidden": [16]},
                  system={"threads": 1, "client_group": "auto"}) as run:
        assert calls == [5]   # the memory-bound size, timed once, on the one worker
        assert run.attrs["client_group"] == expected
        assert run.attrs["client_group_probe"] == {
            "group": 5, "sequential_s": times[0], "group_s": times[1], "chosen": expected}


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_the_probe_times_both_paths_and_changes_nothing(name):
    """The real probe, on the 2NN's hand-written gradient and the CNN's: two positive
    times, and the model's parameters and gradient buffer as they were."""
    from fedmpi.runtime.grouping import probe

    torch.manual_seed(0)
    options = {"hidden": [16]} if name == "2nn" else \
        {k: v for k, v in TINY["model"].items() if k != "name"}
    net = build_model(name, 1, 10, 16, **options)
    flat = FlatModel(net)
    before = flat.params.detach().clone()
    sequential, grouped = probe(flat, 4, 8, (1, 16, 16), 10, None, passes=1)
    assert sequential > 0 and grouped > 0
    assert torch.equal(flat.params, before)
    assert not flat.grads.any()


def test_the_probe_times_one_pass_after_a_long_warm_up(monkeypatch):
    """A step that takes long (ResNet-18 on a CPU: seconds) is timed once after its
    warm-up, not three times: the set-up stays short; a quick one gets three passes."""
    from fedmpi.runtime import grouping

    calls = []
    assert grouping._best(3, lambda: calls.append(1)) >= 0 and len(calls) == 4
    monkeypatch.setattr(grouping, "PROBE_LONG", -1.0)   # every warm-up counts as long
    calls.clear()
    grouping._best(3, lambda: calls.append(1))
    assert len(calls) == 2


def test_a_resumed_auto_run_keeps_the_group_its_file_chose(tmp_path, monkeypatch):
    """The probe could choose otherwise on the resume (another machine, another load):
    here groups win the first time and lose every time after. The resumed run keeps the
    file's size without timing again, so it goes on bit for bit."""
    from fedmpi.runtime import grouping
    from helpers import run_and_resume

    calls = []
    monkeypatch.setattr(grouping, "probe",
                        lambda *a, **k: calls.append(1) or ((1.0, 0.5) if len(calls) == 1 else (1.0, 2.0)))
    values = merged(TINY, rounds=3, system={"threads": 1, "client_group": "auto"})
    values["model"] = {"name": "2nn", "hidden": [16]}
    crashed, exp = run_and_resume(values, tmp_path)
    assert exp.group == 5 and len(calls) == 1
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert a.attrs["client_group"] == 5
        assert b.attrs["resumes"][-1]["client_group"] == 5
        np.testing.assert_array_equal(a.model(), b.model())


def test_a_grouped_run_of_the_padded_cnn_follows_the_sequential_run(tmp_path):
    """The paper's CNN (model.padding = "same") in groups of 3 on the tiny run: the model
    and rows of one client after another, up to rounding; both files record the padding."""
    model = {**TINY["model"], "padding": "same"}
    one = run_tiny(tmp_path, "one", model=model, system={"threads": 1})
    grouped = run_tiny(tmp_path, "grouped", model=model, system={"threads": 1, "client_group": 3})
    with one, grouped:
        assert one.config["model"]["padding"] == grouped.config["model"]["padding"] == "same"
        assert grouped.attrs["client_group"] == 3 and one.attrs["client_group"] == 1
        # 4 x 4 x 8 features after the padded blocks on 16 x 16 images (1 x 1 x 8 unpadded)
        assert grouped.state_dict()["body.7.weight"].shape == (32, 128)
        np.testing.assert_allclose(grouped.model(), one.model(), rtol=1e-4, atol=1e-5)
        a, b = one.clients(), grouped.clients()
        for column in ("client", "steps", "n_samples", "bytes_up", "bytes_down"):
            assert np.array_equal(a[column], b[column])
        np.testing.assert_allclose(b["train_loss"], a["train_loss"], rtol=1e-4)


def test_a_grouped_run_follows_the_sequential_run(tmp_path):
    """SCAFFOLD (client state through the store) in groups of 3 on the tiny run: the same
    model up to rounding, the same rows, the same traffic."""
    one = run_tiny(tmp_path, "one", algorithm={"name": "scaffold"}, system={"threads": 1})
    grouped = run_tiny(tmp_path, "grouped", algorithm={"name": "scaffold"},
                       system={"threads": 1, "client_group": 3})
    with one, grouped:
        np.testing.assert_allclose(grouped.model(), one.model(), rtol=1e-4, atol=1e-5)
        a, b = one.clients(), grouped.clients()
        for column in ("client", "steps", "n_samples", "bytes_up", "bytes_down"):
            assert np.array_equal(a[column], b[column])
        np.testing.assert_allclose(b["train_loss"], a["train_loss"], rtol=1e-4)
        assert grouped.config["system"]["client_group"] == 3


@pytest.mark.parametrize("name", ["fedper", "lg_fedavg", "fedbn", "fedrep", "fedbabu", "ditto",
                                  "apfl", "pfedme", "fedala", "fedrod", "perfedavg"])
def test_private_layers_train_in_groups_each_client_from_its_own_model(tmp_path, name):
    """FedPer's heads, LG-FedAvg's bodies and FedBN's GroupNorm layers stay with the
    clients, as Ditto's and APFL's personal models do; in a group each row starts from its
    client's own model (Ditto: the personal rows after the global ones; APFL: v and alpha
    stepped at each row's w in a gradient hook): the shared model,
    every client's personal scores and the traffic of one client after another, up to
    rounding (3 rounds, so clients come back to their private layers)."""
    over = dict(rounds=3, algorithm={"name": name}, eval={"every": 1, "clients": "all"},
                partition={**TINY["partition"], "local_test": 0.2})
    if name == "fedbn":
        over["model"] = {**TINY["model"], "norm": "group"}
    if name == "fedrep":   # the head's epoch, then the body's (FedRep's alternation)
        over["train"] = {**TINY["train"], "local_epochs": 2}
    one = run_tiny(tmp_path, "one", system={"threads": 1}, **over)
    grouped = run_tiny(tmp_path, "grouped", system={"threads": 1, "client_group": 3}, **over)
    with one, grouped:
        assert grouped.attrs["client_group"] == 3
        np.testing.assert_allclose(grouped.model(), one.model(), rtol=1e-4, atol=1e-5)
        a, b = one.clients(), grouped.clients()
        for column in ("client", "steps", "n_samples", "bytes_up", "bytes_down"):
            assert np.array_equal(a[column], b[column])
        ea, eb = one.client_eval(), grouped.client_eval()
        np.testing.assert_allclose(eb["loss"], ea["loss"], rtol=1e-3, atol=1e-4)
        assert np.abs(eb["accuracy"] - ea["accuracy"]).max() <= 0.1   # argmax ties may flip one sample
    none = run_tiny(tmp_path, "none", system={"threads": 1, "client_group": 3},
                    **{**over, "algorithm": {"name": "fedper", "private": []}})
    fedavg = run_tiny(tmp_path, "fedavg", system={"threads": 1, "client_group": 3},
                      **{**over, "algorithm": {"name": "fedavg"}})
    with none, fedavg:   # no private layers: FedAvg's groups, bit for bit
        assert np.array_equal(none.model(), fedavg.model())


@pytest.mark.parametrize("model", GROUP_FORMS)
def test_a_grouped_run_that_diverges_stops_as_a_sequential_one_does(tmp_path, model):
    """NaN/Inf from a group (the CNN's and the 2NN's hand-written gradients, vmap's)
    reaches the divergence check like a sequential client's: the file says failed at
    round 1."""
    with run_tiny(tmp_path, "nan", model=model or {}, train={"lr": 1e30, "grad_clip": 0.0},
                  system={"threads": 1, "client_group": 3}) as run:
        assert run.status == "failed" and run.attrs["failed_round"] == 1
        assert run.attrs["client_group"] == 3 and "diverged at round 1" in run.attrs["error"]


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", ["fedper", "ditto", "apfl", "pfedme", "fedala", "fedrod",
                                  "perfedavg"])
def test_grouped_private_layers_are_bitwise_the_same_for_1_and_3_ranks(tmp_path, name):
    """FedPer, Ditto, APFL and pFedMe in groups of 2: each client's head (personal model) from the store,
    through flat buffers, into its row; 1 process and 3 ranks write the same model and
    personal scores."""
    values = merged(TINY, algorithm={"name": name}, eval={"every": 1, "clients": "all"},
                    partition={"local_test": 0.2},
                    system={"deterministic": True, "client_group": 2}, rounds=3)
    config = write_config(tmp_path / "p.toml", base=values)
    runs = []
    for out in run_on_ranks(config, (1, 3), tmp_path).values():
        with RunFile(out) as run:
            runs.append((run.model(), run.client_eval()))
    assert np.array_equal(runs[0][0], runs[1][0])
    for column in ("accuracy", "loss"):
        assert np.array_equal(runs[0][1][column], runs[1][1][column])


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("model", GROUP_FORMS)
def test_deterministic_groups_are_bitwise_the_same_for_1_and_3_ranks(tmp_path, model):
    """Groups are cut from the participants and placed whole, so the same groups train
    on any layout: 1 process and 3 ranks (2 workers, each with whole groups) write the
    same bits (group "auto" would not: it depends on the number of workers); the CNN's
    and the 2NN's hand-written gradients and vmap's kernels alike."""
    values = merged(TINY, algorithm={"name": "feddyn"},
                    system={"deterministic": True, "client_group": 2}, rounds=2)
    values["model"] = model or values["model"]
    config = write_config(tmp_path / "g.toml", base=values)
    models = []
    for out in run_on_ranks(config, (1, 3), tmp_path).values():
        with RunFile(out) as run:
            models.append(run.model())
    assert np.array_equal(models[0], models[1])


# ---- refused at config time ---------------------------------------------------------------

@pytest.mark.parametrize("value,message", [
    (0, "system.client_group: must be an integer in [1, 4096]"),
    (-3, "must be an integer in [1, 4096]"), (5000, "must be an integer in [1, 4096]"),
    ("big", "or \"auto\", got 'big'"), (2.5, "expected an integer or a string"),
    (True, "expected an integer or a string")])
def test_bad_group_values_are_one_line_errors(value, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, system={"client_group": value}))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("over,message", [
    (dict(algorithm={"name": "moon", "mu": 1.0}, model={"proj_dim": 8}),
     "algorithm 'moon' has no group form"),
    (dict(algorithm={"name": "fedmim"}), "algorithm 'fedmim' has no group form"),
    (dict(model={"name": "vgg11"}), "model 'vgg11' has dropout (model.dropout = 0.5)"),
])
def test_what_cannot_train_in_groups_is_refused(over, message):
    def config(group):
        values = merged(TINY, system={"client_group": group}, **over)
        values["model"] = over.get("model", values["model"])
        return values
    with pytest.raises(UsageError) as err:
        cfg.from_dict(config(4))
    assert message in str(err.value) and "\n" not in str(err.value)
    cfg.from_dict(config(1))   # fine one by one
    cfg.from_dict(config("auto"))   # and "auto" means one by one here


def test_models_a_group_cannot_share():
    assert "model 'lstm' is recurrent" in group_problem("lstm", {})
    assert group_problem("vgg11", {"dropout": 0.0}) is None
    assert group_problem("cnn", {}) is None and group_problem("2nn", {}) is None


def test_refusal_through_the_cli_exits_2_and_writes_nothing(tmp_path):
    config = write_config(tmp_path / "bad.toml", algorithm={"name": "fedbyol"},
                          system={"client_group": 4})
    out = tmp_path / "never.h5"
    proc = fedmpi(["run", "-q", str(config), "-o", str(out)])
    assert proc.returncode == 2 and not out.exists()
    assert "system.client_group" in proc.stderr and "fedbyol" in proc.stderr
