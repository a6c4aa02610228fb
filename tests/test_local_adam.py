"""train.optimizer = "adam": the local step against torch.optim.Adam on the same module and
batches, its moments zeroed in every local update, the default "sgd" unchanged, what adam
is refused with at config time, and a real self-supervised run (FedU^2's clients train
with Adam)."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi import config as cfg
from fedmpi.algorithms import ClientTask, build
from fedmpi.algorithms.base import ClientData
from fedmpi.algorithms.local_sgd import AdamMoments, adam_step, local_update, train
from fedmpi.comm import LocalComm
from fedmpi.config.validate import group_refusal
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from harness import Simulation, context, quadratic_task
from helpers import SSL, TINY, merged


class Fixed(ClientData):
    """The same list of (x, y) batches in every epoch."""

    def __init__(self, batches):
        self.list = batches
        self.num_samples = sum(len(y) for _, y in batches)

    def batches(self, epochs, batch_size):
        return iter(self.list * epochs)

    def num_steps(self, epochs, batch_size):
        return epochs * len(self.list)


def setup(steps=4, seed=0):
    """A small MLP as a flat model, an identical copy of it, and ``steps`` batches."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    batches = [(torch.randn(8, 1, 3, 4), torch.randint(0, 3, (8,))) for _ in range(steps)]
    reference = copy.deepcopy(module)
    flat = FlatModel(module)
    task = ClientTask(0, Fixed(batches), flat, torch.device("cpu"))
    return task, reference, batches


def torch_adam(module, batches, lrs, weight_decay=0.0, grad_clip=0.0, betas=(0.9, 0.999),
               eps=1e-8):
    """torch.optim.Adam over ``batches``, step k at lrs[k]; clipping as fedmpi's (the
    gradient scaled by min(1, clip / (||g|| + 1e-6)), before the weight decay)."""
    opt = torch.optim.Adam(module.parameters(), lr=lrs[0], betas=betas, eps=eps,
                           weight_decay=weight_decay, foreach=False)
    for (x, y), lr in zip(batches, lrs):
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        if grad_clip:
            norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in module.parameters()]))
            for p in module.parameters():
                p.grad.mul_(min(1.0, grad_clip / (float(norm) + 1e-6)))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def ours(task):
    return torch.cat([p.detach().flatten() for p in task.model.module.parameters()])


@pytest.mark.parametrize("options", [
    {},
    {"weight_decay": 1e-2, "grad_clip": 0.05},          # clips every step, decay after it
    {"adam_betas": (0.5, 0.9), "adam_eps": 1e-3, "weight_decay": 0.1},
])
def test_k_adam_steps_are_torch_optim_adams_bit_for_bit(options):
    task, reference, batches = setup()
    ctx = context(lr=0.01, optimizer="adam", **options)
    loss, steps = train(task, ctx)
    expected = torch_adam(reference, batches, [0.01] * 4, options.get("weight_decay", 0.0),
                          options.get("grad_clip", 0.0), options.get("adam_betas", (0.9, 0.999)),
                          options.get("adam_eps", 1e-8))
    assert steps == 4 and math.isfinite(loss)
    assert torch.equal(ours(task), expected)


def test_adam_takes_the_local_schedules_learning_rates():
    # cosine within the round over K = 4 steps, two epochs of 2 batches
    task, reference, batches = setup(steps=2)
    ctx = context(lr=0.02, optimizer="adam", local_epochs=2, local_schedule="cosine")
    train(task, ctx)
    lrs = [0.02 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
    expected = torch_adam(reference, batches * 2, lrs)
    assert torch.allclose(ours(task), expected, rtol=0, atol=1e-7)


def test_adam_step_by_hand():
    # one step from m = v = 0 with g = grads + wd w: m = (1 - b1) g, v = (1 - b2) g^2, and
    # the bias corrections make the step lr g / (|g| + eps), lr sign(g) up to eps
    w, g = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.0, -4.0])
    moments = AdamMoments(g)
    adam_step(w, g.clone(), 0.1, 0.5, 0.0, moments)
    g_total = torch.tensor([0.3 + 0.5, -1.0, -4.0 + 0.25])
    assert torch.allclose(moments.exp_avg, 0.1 * g_total)
    assert torch.allclose(moments.exp_avg_sq, 0.001 * g_total ** 2)
    expected = torch.tensor([1.0, -2.0, 0.5]) - 0.1 * g_total / (g_total.abs() + 1e-8)
    assert torch.allclose(w, expected, atol=1e-6) and moments.step == 1


def test_moments_start_at_zero_in_every_local_update():
    # Two rounds of one client from the same model give the same update: nothing carried.
    sim = Simulation(build("fedavg", {}), {0: quadratic_task(0, [1.0, -3.0], steps=3)},
                     x0=[0.0, 0.0])
    sim.round([0], lr=0.1, optimizer="adam")
    first = sim.state["x"].clone()
    sim.state["x"].zero_()
    sim.round([0], lr=0.1, optimizer="adam")
    assert torch.equal(sim.state["x"], first)
    # Adam's first steps move each coordinate by about lr, whatever its gradient's size
    assert torch.allclose(first, torch.tensor([0.3, -0.3]), atol=2e-3)


def test_local_update_with_adam_returns_the_trained_delta():
    task, _, _ = setup()
    x = task.model.params.clone()
    upload = local_update(task, x, context(lr=0.01, optimizer="adam"))
    assert torch.equal(upload.delta, task.model.params - x) and upload.steps == 4
    assert upload.delta.abs().max() > 0


def run(tmp_path, name, base=TINY, **sections):
    values = merged(base, output=str(tmp_path / f"{name}.h5"), rounds=2, **sections)
    c = cfg.from_dict(values)
    run_experiment(c, LocalComm(), quiet=True)
    return RunFile(c.output_path())


def test_default_sgd_is_unchanged_bit_for_bit(tmp_path):
    """optimizer unset and "sgd" are the same run; "adam" is another (and recorded)."""
    with run(tmp_path, "unset") as unset, run(tmp_path, "sgd", train={"optimizer": "sgd"}) as sgd, \
            run(tmp_path, "adam", train={"optimizer": "adam", "lr": 1e-3}) as adam:
        assert np.array_equal(unset.model(), sgd.model())
        assert np.array_equal(unset.rounds()["train_loss"], sgd.rounds()["train_loss"],
                              equal_nan=True)
        assert unset.config["train"]["optimizer"] == "sgd"
        assert adam.config["train"]["optimizer"] == "adam"
        assert adam.config["train"]["adam_betas"] == [0.9, 0.999]
        assert adam.config["train"]["adam_eps"] == 1e-8
        assert not np.array_equal(unset.model(), adam.model())
        assert adam.attrs["status"] == "completed"


def test_fedsimsiam_trains_with_adam(tmp_path):
    """FedU^2's local optimizer on a self-supervised method: a real run completes, and
    its file says adam ran."""
    with run(tmp_path, "simsiam", base=SSL, algorithm={"name": "fedsimsiam"},
             train={"optimizer": "adam", "lr": 1e-3, "weight_decay": 5e-4}) as f:
        assert f.attrs["status"] == "completed"
        assert f.config["train"]["optimizer"] == "adam"
        assert np.all(np.isfinite(f.rounds()["train_loss"][1:]))


def refused(field, **sections):
    with pytest.raises(UsageError, match=f"^config field {field}:") as info:
        cfg.from_dict(merged(TINY, **sections))
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("train, field, says", [
    ({"optimizer": "adamw"}, "train.optimizer", "choose one of adam, sgd"),
    ({"optimizer": "adam", "momentum": 0.9}, "train.momentum", "must be 0 with train.optimizer"),
    ({"optimizer": "adam", "momentum": 0.9, "nesterov": True}, "train.nesterov", "must be false"),
    ({"adam_betas": [0.9]}, "train.adam_betas", "two numbers in [0, 1)"),
    ({"adam_betas": [0.9, 1.0]}, "train.adam_betas", "two numbers in [0, 1)"),
    ({"adam_betas": [-0.1, 0.999]}, "train.adam_betas", "two numbers in [0, 1)"),
    ({"adam_betas": [0.9, 0.999, 0.5]}, "train.adam_betas", "two numbers in [0, 1)"),
    ({"adam_betas": "0.9"}, "train.adam_betas", "expected a list of numbers"),
    ({"adam_eps": 0.0}, "train.adam_eps", "must be > 0"),
    ({"adam_eps": float("nan")}, "train.adam_eps", "finite"),
])
def test_bad_adam_settings_are_refused_by_name(train, field, says):
    assert says in refused(field, train=train)


def test_client_groups_are_refused_with_adam_and_auto_trains_one_by_one():
    message = refused("system.client_group", train={"optimizer": "adam"},
                      system={"client_group": 2})
    assert "train.optimizer 'adam' has no group form" in message
    auto = cfg.from_dict(merged(TINY, train={"optimizer": "adam"}, system={"client_group": "auto"}))
    assert group_refusal(auto)   # "auto" resolves to 1 (fedmpi.runtime.experiment)


SGD_ONLY = ["scaffold", "fednova", "fedcm", "mofedsam", "fedmrur", "fedmim"]
ADAM_OK = ["fedavg", "fedprox", "feddyn", "fedacg", "fedsam", "fedavgm", "fedadam", "fedexp"]


@pytest.mark.parametrize("name", SGD_ONLY)
def test_methods_whose_formulas_assume_sgd_steps_refuse_adam(name):
    message = refused("train.optimizer", algorithm={"name": name}, train={"optimizer": "adam"})
    assert f"'adam' is not allowed with '{name}'" in message and 'use "sgd"' in message
    cfg.from_dict(merged(TINY, algorithm={"name": name}, train={"optimizer": "sgd"}))


def test_fnrfl_refuses_adam_over_an_sgd_only_base_and_takes_it_over_fedavg():
    over = {"name": "fnrfl", "base": "scaffold"}
    message = refused("train.optimizer", algorithm=over, train={"optimizer": "adam"},
                      data={"public_size": 40})
    assert "'fnrfl' over 'scaffold'" in message
    cfg.from_dict(merged(TINY, algorithm={"name": "fnrfl", "base": "fedavg"},
                         train={"optimizer": "adam"}, data={"public_size": 40}))


@pytest.mark.parametrize("name", ADAM_OK)
def test_methods_that_hold_for_any_local_optimizer_take_adam(name):
    c = cfg.from_dict(merged(TINY, algorithm={"name": name}, train={"optimizer": "adam"}))
    assert c.train.optimizer == "adam"


def test_moon_and_the_self_supervised_methods_take_adam():
    cfg.from_dict(merged(TINY, algorithm={"name": "moon"}, model={"proj_dim": 16},
                         train={"optimizer": "adam"}))
    for name in ("fedsimsiam", "fedsimclr", "fedbyol", "fedu", "fedema", "fedu2"):
        algorithm = {"name": name, "proj_dim": 16, "proj_hidden": 32}
        cfg.from_dict({**SSL, "algorithm": algorithm, "train": {"optimizer": "adam"}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_adam_on_a_gpu_never_waits_for_the_device():
    """The step with clipping and decay under CUDA's sync debug mode: no host sync."""
    device = torch.device("cuda")
    w = torch.randn(1000, device=device)
    moments = AdamMoments(w)
    g = torch.randn(1000, device=device)
    reference = w.clone().requires_grad_(True)
    opt = torch.optim.Adam([reference], lr=0.01, weight_decay=0.1, foreach=False)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            adam_step(w, g.clone(), 0.01, 0.1, 1e6, moments)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(3):
        reference.grad = g.clone()
        opt.step()
    assert torch.allclose(w, reference.detach(), rtol=0, atol=1e-6)
