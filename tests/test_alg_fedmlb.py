"""FedMLB: the models' blocks compose to their features bit for bit, lambda1 = lambda2 = 0
is FedAvg bit for bit, two local steps against a hand-written loss, a real run with its
FL bytes, and the refusals (bad parameters, a model without blocks)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfg
from fedmpi.algorithms import REGISTRY, build, message_sizes, resolved_params
from fedmpi.algorithms.base import ClientData, ClientTask
from fedmpi.algorithms.fedmlb import kd, mlb_loss, models_with_blocks
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model, check_options

from harness import context
from helpers import TINY, merged
from test_runtime import run_tiny

NO_BLOCKS = r"^config field model.name: fedmlb needs a model that declares blocks, " \
            r"one of 'cnn', 'resnet18', 'vgg11'"


def compose(blocks, x):
    for block in blocks:
        x = block(x)
    return x


@pytest.mark.parametrize("name,opts,size,count", [
    ("cnn", {"hidden": 12, "channels": [2, 3]}, 16, 3),
    ("cnn", {"hidden": 12, "channels": [2, 3], "padding": "same"}, 16, 3),
    ("resnet18", {}, 8, 5),
    ("resnet18", {"stem": "imagenet"}, 16, 5),
    ("vgg11", {}, 8, 6),
    ("vgg11", {"norm": "group", "dropout": 0.0}, 8, 6)])
def test_blocks_compose_to_the_features_bit_for_bit_and_change_no_parameter(name, opts, size,
                                                                              count):
    torch.manual_seed(0)
    model = build_model(name, 3, 5, size, **opts).eval()   # eval: VGG's dropout off
    before = [(n, p.clone()) for n, p in model.named_parameters()]
    blocks = model.blocks()
    after = list(model.named_parameters())
    assert [n for n, _ in before] == [n for n, _ in after]   # nothing re-registered
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(before, after))
    assert len(blocks) == count
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(compose(blocks, x), model.features(x))
    # the blocks hold exactly the features' parameters (all but the classifier's), once each
    in_blocks = [id(p) for b in blocks for p in b.parameters()]
    features = [id(p) for n, p in model.named_parameters() if not n.startswith("classifier.")]
    assert sorted(in_blocks) == sorted(features)


def test_models_without_blocks_declare_none():
    assert models_with_blocks() == ("cnn", "resnet18", "vgg11")
    assert build_model("2nn", 1, 5, 8).blocks() is None
    assert build_model("mlp", 6, 5, 1).blocks() is None
    assert build_model("lstm", 80, 80, 1).blocks() is None


class Batches(ClientData):
    def __init__(self, batches):
        self.items, self.num_samples = batches, sum(len(y) for _, y in batches)

    def batches(self, epochs, batch_size):
        yield from self.items * epochs


CNN = {"hidden": 12, "channels": [2, 3]}


def cnn_task(steps=2, name="cnn", opts=CNN):
    torch.manual_seed(1)
    flat = FlatModel(build_model(name, 3, 5, 16, **opts))
    gen = torch.Generator().manual_seed(2)
    data = Batches([(torch.randn(4, 3, 16, 16, generator=gen), torch.tensor([0, 1, 2, 4]))
                    for _ in range(steps)])
    return ClientTask(0, data, flat, torch.device("cpu")), gen


def test_zero_weights_are_fedavg_bit_for_bit():
    task, _ = cnn_task(steps=3)
    x = task.model.params.detach().clone()
    ctx = context(lr=0.05, weight_decay=1e-3, grad_clip=1.0, momentum=0.9)
    mlb = build("fedmlb", {"lambda1": 0.0, "lambda2": 0.0}).local_update(task, {"x": x}, None, ctx)
    avg = build("fedavg", {}).local_update(task, {"x": x}, None, ctx)
    assert torch.equal(mlb.delta, avg.delta) and mlb.loss == avg.loss and mlb.steps == 3
    default = build("fedmlb", {}).local_update(task, {"x": x}, None, ctx)
    assert not torch.equal(default.delta, avg.delta)


def hybrid_by_hand(m, g, xb, level):
    """The CNN's main pathway (level None) or its hybrid at level 1..3, layer by layer:
    the local module ``m`` up to the level, the global ``g`` after it."""
    def conv(mod, i, h):
        return F.max_pool2d(F.relu(mod.body[i](h)), 2)

    def fc(mod, h):
        return F.relu(mod.body[7](h.flatten(1)))
    stages = [lambda mod, h: conv(mod, 0, h), lambda mod, h: conv(mod, 3, h), fc]
    h = xb
    for i, stage in enumerate(stages):
        h = stage(m if level is None or i < level else g, h)
    return (g if level is not None else m).classifier(h)


def test_two_local_steps_match_a_hand_written_loss():
    lam1, lam2, tau, lr = 0.7, 0.3, 2.0, 0.1
    task, _ = cnn_task(steps=2)
    flat = task.model
    x = flat.params.detach().clone()
    upload = build("fedmlb", {"lambda1": lam1, "lambda2": lam2, "tau": tau}).local_update(
        task, {"x": x}, None, context(lr=lr))

    def module_at(vec):  # a plain module with standard-layout weights from a storage-order vector
        torch.manual_seed(1)
        m = build_model("cnn", 3, 5, 16, **CNN)
        m.load_state_dict(flat.state_dict_of(vec))
        return m

    local, glob = module_at(x), module_at(x)
    glob.requires_grad_(False)
    losses = []
    for xb, yb in task.data.items:
        z_main = hybrid_by_hand(local, glob, xb, None)
        ce_h, kl_h = 0.0, 0.0
        for level in (1, 2, 3):
            z = hybrid_by_hand(local, glob, xb, level)
            ce_h = ce_h + F.cross_entropy(z, yb)
            p, q = torch.softmax(z / tau, 1), torch.softmax(z_main / tau, 1)
            kl_h = kl_h + (p * (p.log() - q.log())).sum(1).mean()
        loss = F.cross_entropy(z_main, yb) + lam1 * ce_h / 3 + lam2 * kl_h / 3
        local.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in local.parameters():
                p -= lr * p.grad
        losses.append(loss.item())
    assert losses[1] != pytest.approx(losses[0])   # the second step's local model differs
    after = flat.state_dict_of(flat.params)
    for name, p in local.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), rtol=1e-5, atol=1e-6)
    assert math.isclose(upload.loss, sum(losses) / 2, rel_tol=1e-5)
    assert torch.equal(upload.delta, flat.params - x)


def test_the_kl_is_hybrid_against_main_without_a_tau_squared_factor():
    gen = torch.Generator().manual_seed(5)
    hybrid, main = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    p, q = torch.softmax(hybrid / 3.0, 1), torch.softmax(main / 3.0, 1)
    torch.testing.assert_close(kd(hybrid, main, 3.0), (p * (p / q).log()).sum() / 3)
    assert not torch.allclose(kd(hybrid, main, 3.0), kd(main, hybrid, 3.0))


def test_the_last_level_is_the_local_features_through_the_global_classifier():
    task, gen = cnn_task(steps=1)
    module = task.model.module
    torch.manual_seed(9)
    glob = build_model("cnn", 3, 5, 16, **CNN).requires_grad_(False)
    xb, yb = task.data.items[0]
    value = mlb_loss(module.blocks(), glob, glob.blocks(), 1.0, 0.0, 1.0)(module, xb, yb)
    hand = F.cross_entropy(module(xb), yb) + sum(
        F.cross_entropy(hybrid_by_hand(module, glob, xb, level), yb) for level in (1, 2, 3)) / 3
    torch.testing.assert_close(value, hand)
    last = glob.classifier(module.features(xb))
    torch.testing.assert_close(last, hybrid_by_hand(module, glob, xb, 3))


def test_a_resnet18_update_runs_and_moves_every_block():
    task, _ = cnn_task(steps=1, name="resnet18", opts={})
    x = task.model.params.detach().clone()
    up = build("fedmlb", {}).local_update(task, {"x": x}, None, context(lr=0.01))
    assert torch.isfinite(up.delta).all() and up.delta.abs().sum() > 0 and math.isfinite(up.loss)


# ---- through the runtime -----------------------------------------------------------------

SMALL = merged(TINY, rounds=2, clients={"num": 6, "per_round": 4}, system={"deterministic": True},
               algorithm={"name": "fedmlb"})


def test_a_real_run_completes_with_fl_bytes_d_down_d_up(tmp_path):
    c, exp, run = run_tiny(tmp_path, "fedmlb", base=SMALL)
    with run:
        assert run.status == "completed"
        assert run.config["algorithm"] == {"name": "fedmlb", "lambda1": 1.0, "lambda2": 1.0,
                                           "tau": 1.0}
        rounds = run.rounds()
        per_client = exp.d * 4
        assert rounds["fl_bytes_down"].tolist() == [0] + [4 * per_client] * 2
        assert rounds["fl_bytes_up"].tolist() == [0] + [4 * per_client] * 2
        assert np.all(run.clients()["bytes_up"] == per_client)
        assert np.all(np.isfinite(rounds["train_loss"][1:]))
    assert message_sizes(REGISTRY["fedmlb"]) == "down d, up d"
    assert build("fedmlb", {}).client_state_sizes(7) == {}
    assert not REGISTRY["fedmlb"].trains_in_groups()


# ---- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("params,field", [
    ({"lambda1": -1.0}, "algorithm.lambda1"),
    ({"lambda2": -0.5}, "algorithm.lambda2"),
    ({"tau": 0.0}, "algorithm.tau"),
    ({"tau": -1.0}, "algorithm.tau"),
    ({"tau": "warm"}, "algorithm.tau"),
    ({"lambda1": float("nan")}, "algorithm.lambda1"),
    ({"lambda3": 1.0}, "algorithm.lambda3")])
def test_bad_parameters_raise_a_one_line_usage_error_naming_the_field(params, field):
    with pytest.raises(UsageError, match=f"^config field {field}: ") as err:
        build("fedmlb", params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model,got", [("2nn", "'2nn' or 'mlp'"), ("mlp", "'2nn' or 'mlp'"),
                                       ("lstm", "'lstm'")])
def test_a_model_without_blocks_is_refused_at_config_time(model, got):
    with pytest.raises(UsageError, match=NO_BLOCKS + f"; got {got}$"):
        resolved_params("fedmlb", {}, check_options(model, {}))
    for ok in ("cnn", "resnet18", "vgg11"):
        resolved_params("fedmlb", {}, check_options(ok, {"proj_dim": 4}))


def test_a_config_with_the_2nn_is_refused_naming_model_name(tmp_path):
    values = merged(SMALL, model={"name": "2nn", "hidden": [8]}, output=str(tmp_path / "x.h5"))
    values["model"].pop("channels")
    with pytest.raises(UsageError, match=NO_BLOCKS) as err:
        cfg.from_dict(values)
    assert "\n" not in str(err.value)


def test_a_model_without_blocks_is_refused_at_local_update_time():
    torch.manual_seed(0)
    flat = FlatModel(build_model("2nn", 3, 5, 8, hidden=(6,)))
    data = Batches([(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))])
    task = ClientTask(0, data, flat, torch.device("cpu"))
    with pytest.raises(UsageError, match=NO_BLOCKS + "; got TwoNN, which declares none$"):
        build("fedmlb", {}).local_update(task, {"x": flat.params.detach().clone()}, None,
                                         context())
