"""Sample-level DP-SGD inside the clients (``privacy.mechanism = "sample"``;
fedmpi.runtime.dp_sgd): per-sample clipping and the fixed denominator in closed form, the
noise's scale, full batches without noise or clip = full-batch local SGD, epsilon from
dp-accounting for the smallest client, 1 and 3 ranks bit for bit, and the refusals."""

import math
import re

import dp_accounting as dpa
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfg
from fedmpi import privacy
from fedmpi.algorithms.base import ClientTask
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime.dp_sgd import PrivateSteps
from fedmpi.runtime.rng import torch_generator

from conftest import fedmpi, needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file

# 4 clients of 96 samples, all every round (cross-silo)
BASE = merged({**TINY, "partition": {"kind": "iid"}}, rounds=2,
              data={**TINY["data"], "num_train": 384}, clients={"num": 4, "per_round": 4},
              system={**TINY["system"], "deterministic": True, "client_group": 1})
SAMPLE = {"mechanism": "sample", "clip": 1.0, "noise_multiplier": 1.0}


run = run_file   # (tmp_path, name, values) -> the finished run's file, open


def _task(module, channels_last=False):
    from fedmpi.flat import FlatModel
    flat = FlatModel(module, torch.device("cpu"), channels_last=channels_last)
    return ClientTask(client=0, data=None, model=flat, device=torch.device("cpu"))


MODELS = {   # name -> (module, channels_last, whether dp_ghost serves it)
    "linear": (lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)), False, True),
    "conv": (lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1, stride=2),
                                         torch.nn.ReLU(), torch.nn.Flatten(),
                                         torch.nn.Linear(16, 3, bias=False)), False, True),
    "conv-nhwc": (lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 4, (2, 2), dilation=(1, 2)),
                                              torch.nn.ReLU(), torch.nn.Flatten(),
                                              torch.nn.Linear(16, 3)), True, True),
    "layernorm": (lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6),
                                              torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)),
                  False, False),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("sigma", [0.0, 3.0])
def test_each_sample_s_gradient_is_clipped_then_summed_noised_and_divided_by_qn(sigma, model):
    """Against autograd one sample at a time, for models the ghost norm serves (Linear,
    Conv2d in either storage order) and models it leaves to the per-sample rows."""
    from fedmpi.runtime.dp_ghost import ghost_of
    build, channels_last, ghost = MODELS[model]
    torch.manual_seed(0)
    task = _task(build(), channels_last)
    x, y = torch.randn(5, 1, 3, 4) * 4, torch.tensor([0, 1, 2, 1, 0])
    served = ghost_of(task.model) is not None and \
        ghost_of(task.model).clipped_sum(x, y, 1.0) is not None
    assert served == ghost
    values = cfg.from_dict(merged(BASE, privacy={**SAMPLE, "clip": 0.7, "noise_multiplier": sigma}))
    steps = PrivateSteps(values, (0, 0, 0))
    steps.expected = 8.0                   # q n: the fixed denominator, not the batch's 5
    loss = steps.gradient(task, x, y)
    module, flat = task.model.module, task.model
    want = torch.zeros(flat.num_params)
    for i in range(5):                     # each sample's gradient by autograd, clipped
        module.zero_grad(set_to_none=True)
        F.cross_entropy(module(x[i:i + 1]), y[i:i + 1]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
        want += g * min(1.0, 0.7 / (float(g.norm()) + 1e-6))
    got = flat.canonical(flat.grads)       # storage order -> the parameters' order
    noise = flat.canonical(torch.randn(flat.num_params,
                                       generator=torch_generator(values.seed, "dp-sgd-noise", 0, 0, 0)))
    assert torch.allclose(got, (want + sigma * 0.7 * noise) / 8.0, rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(float(F.cross_entropy(module(x), y).detach()), rel=1e-5)


def test_a_layer_called_twice_is_left_to_the_general_path():
    from fedmpi.runtime.dp_ghost import ghost_of
    layer = torch.nn.Linear(12, 12)
    task = _task(torch.nn.Sequential(torch.nn.Flatten(), layer, torch.nn.Tanh(), layer))
    ghost = ghost_of(task.model)
    assert ghost is not None
    assert ghost.clipped_sum(torch.randn(5, 1, 3, 4), torch.tensor([0, 1, 2, 1, 0]), 1.0) is None


def test_full_batches_without_noise_or_clip_are_full_batch_local_sgd(tmp_path):
    """q = 1 (B >= n): every sample in every step and the denominator n, so the step is the
    batch mean's: the plain run with one batch of all 96 samples, up to float rounding
    (the sums run in another order)."""
    full = merged(BASE, train={**TINY["train"], "batch_size": 128, "local_epochs": 3,
                               "grad_clip": 0.0})
    with run(tmp_path, "plain", full) as plain, \
            run(tmp_path, "dp", merged(full, privacy={**SAMPLE, "clip": 1e30,
                                                      "noise_multiplier": 0.0})) as private:
        assert np.allclose(plain.model(), private.model(), rtol=1e-4, atol=1e-6)
        assert np.isinf(private.rounds()["epsilon"][1:]).all()


def test_epsilon_is_the_smallest_client_s_composed_by_dp_accounting(tmp_path):
    values = merged(BASE, partition={"kind": "dirichlet", "alpha": 0.5},
                    privacy={**SAMPLE, "noise_multiplier": 1.5})
    with run(tmp_path, "run", values) as r:
        got, attrs = r.rounds()["epsilon"][1:].tolist(), r.attrs
        sizes = np.diff(r.partition()["client_offsets"])
    n = int(sizes[sizes > 0].min())
    q, steps = min(1.0, 16 / n), -(-n // 16)
    assert attrs["privacy_sample_smallest_client"] == n and attrs["privacy_sample_rate"] == q
    want = []
    for t in (1, 2):
        accountant = dpa.rdp.RdpAccountant()
        step = dpa.GaussianDpEvent(1.5) if q >= 1 else \
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.5))
        accountant.compose(dpa.SelfComposedDpEvent(step, steps), t)
        want.append(accountant.get_epsilon(1e-5))
    assert got == want and attrs["privacy_delta"] == 1e-5
    poisson = cfg.from_dict(merged(values, clients={"num": 4, "per_round": 2,
                                                    "sampling": "bernoulli"}))
    assert privacy.accountant_of(poisson) == "rdp"      # "auto": PLD is central DP's


def test_a_target_epsilon_is_met_by_the_smallest_client_and_resumes_to_the_same_noise(tmp_path):
    """target_epsilon: sigma calibrated at start-up for the smallest client (known once the
    data are partitioned): its epsilon after the last round is the target (to the search's
    tolerance), the file records that sigma, a run given that sigma directly is the same
    run bit for bit, and a resume recalibrates to the same sigma."""
    values = merged(BASE, partition={"kind": "dirichlet", "alpha": 0.5},
                    privacy={**SAMPLE, "noise_multiplier": 0.0, "target_epsilon": 3.0})
    crashed, _ = run_and_resume(values, tmp_path)
    with run(tmp_path, "calibrated", values) as r:
        sigma, eps, model = r.attrs["privacy_noise_multiplier"], r.rounds()["epsilon"], r.model()
        n = r.attrs["privacy_sample_smallest_client"]
    assert 0 < sigma and 3.0 * (1 - 1e-3) <= eps[-1] <= 3.0
    q, steps = privacy.sample_steps(cfg.from_dict(values), n)
    accountant = dpa.rdp.RdpAccountant()    # dp-accounting directly, at sigma and sigma * 0.99
    step = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(0.99 * sigma)) if q < 1 else \
        dpa.GaussianDpEvent(0.99 * sigma)
    accountant.compose(dpa.SelfComposedDpEvent(step, steps), 2)
    assert accountant.get_epsilon(1e-5) > 3.0           # the smallest sigma, not any
    given = merged(values, privacy={**SAMPLE, "noise_multiplier": sigma})
    with run(tmp_path, "given", given) as r, RunFile(crashed) as resumed:
        assert np.array_equal(r.model(), model) and np.array_equal(resumed.model(), model)
        assert resumed.attrs["privacy_noise_multiplier"] == sigma


def test_the_noise_has_std_sigma_clip_over_qn(tmp_path):
    """One client, one round, lr 1: the model moves by -lr x (the steps' gradients); with
    a clip of 1e-12 the data's part is ~0 and each coordinate's move is a sum of K noise
    draws of std sigma C / (q n): std sqrt(K) sigma C / (q n)."""
    still = merged(BASE, rounds=1, clients={"num": 1, "per_round": 1},
                   data={**TINY["data"], "num_train": 200}, model={**TINY["model"], "hidden": 2048},
                   train={**TINY["train"], "lr": 1.0, "batch_size": 50})
    with run(tmp_path, "quiet", merged(still, privacy={**SAMPLE, "clip": 1e-12,
                                                       "noise_multiplier": 0.0})) as a, \
            run(tmp_path, "noisy", merged(still, privacy={**SAMPLE, "clip": 1e-12,
                                                          "noise_multiplier": 2e10})) as b:
        moved = (b.model() - a.model()).astype(np.float64)
    d = moved.size
    want = math.sqrt(4) * 2e10 * 1e-12 / 50        # K = 200 / 50 steps, q n = 50
    assert d > 20_000
    assert abs(moved.std() / want - 1) < 6 / math.sqrt(2 * d)


@pytest.mark.slow
@needs_mpi
def test_dp_sgd_runs_are_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    assert_same_on_3_ranks(tmp_path, merged(BASE, privacy=SAMPLE), ["epsilon"])


@pytest.mark.parametrize("over, message", [
    ({"algorithm": {"name": "moon"}, "model": {**TINY["model"], "proj_dim": 8}},
     "privacy.mechanism: sample-level DP-SGD replaces the local steps' gradient; 'moon' "
     "computes its own"),
    ({"system": {**TINY["system"], "client_group": 2}},
     "system.client_group: privacy.mechanism \"sample\" (DP-SGD) takes each client's "
     "per-sample gradients on its own"),
    ({"privacy": {**SAMPLE, "audit_canaries": 10}}, "privacy.audit_canaries: needs"),
    ({"model": {**TINY["model"], "norm": "batch"}},
     "model.norm: privacy.mechanism \"sample\" clips each sample's gradient; BatchNorm mixes "
     "the samples of a batch"),
])
def test_what_dp_sgd_cannot_do_is_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(BASE, **{"privacy": SAMPLE, **over}))


def test_the_privacy_command_says_dp_sgd_s_epsilon_comes_from_the_run():
    out = fedmpi(["privacy", "--set", "privacy.mechanism=\"sample\"", "--set",
                  "privacy.noise_multiplier=1"])
    assert out.returncode == 2 and out.stderr.strip() == (
        "fedmpi: config field privacy.mechanism: sample-level DP's epsilon depends on the "
        "clients' sizes, which the data give: a run writes it after every round "
        "(/rounds/epsilon)")
