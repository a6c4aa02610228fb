"""APFL, pFedMe, Per-FedAvg, FedRoD and FedALA (fedmpi.algorithms.apfl, pfedme, perfedavg,
fedrod, fedala): each reduces to what it must (APFL's global model is FedAvg's, alpha = 0
scores the global model, alpha = 1 keeps the local model FedAvg's client trains;
Per-FedAvg's Hessian-free step is the exact MAML gradient when D'' = D; FedRoD's global
model is its generic one; FedALA's new client trains from x^t), their personal models are client state scored by
per-client evaluation, 1 and 3 ranks and a resume give the same bits, and bad parameters
are refused in one line."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfg
from fedmpi.algorithms import ClientTask
from fedmpi.algorithms.local_sgd import cross_entropy
from fedmpi.algorithms.perfedavg import meta_gradient
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile

from conftest import needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file

SPLIT = merged(TINY, partition={**TINY["partition"], "local_test": 0.25},
               eval={**TINY["eval"], "clients": "all"})
DETERMINISTIC = {**TINY["system"], "deterministic": True}


def method(name, base=SPLIT, **params):
    return merged(base, algorithm={"name": name, **params})


def test_apfl_s_global_model_is_fedavg_s_and_alpha_0_scores_it(tmp_path):
    with run_file(tmp_path, "apfl", method("apfl")) as a, \
            run_file(tmp_path, "zero", method("apfl", alpha=0.0, adaptive=False)) as z, \
            run_file(tmp_path, "fedavg", SPLIT) as f:
        assert np.array_equal(a.model(), f.model()) and np.array_equal(z.model(), f.model())
        assert np.array_equal(a.client_eval()["accuracy"], f.client_eval()["accuracy"])
        zero = z.client_eval()
        assert np.array_equal(zero["personal_accuracy"], zero["accuracy"])
        assert not np.array_equal(a.client_eval()["personal_accuracy"], a.client_eval()["accuracy"])


def test_apfl_with_alpha_1_keeps_the_local_model_and_adaptive_alpha_stays_in_0_1(tmp_path):
    """alpha = 1 (fixed): vbar = v, and v takes the very steps w takes from the same start
    over the same batches, so after one client's round v = x^0 + Delta = x^1 (up to the
    rounding of FedAvg's mean of one update)."""
    one = merged(SPLIT, rounds=2, clients={**TINY["clients"], "per_round": 1},
                 system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "one", method("apfl", one, alpha=1.0, adaptive=False)) as r:
        ckpt = r.checkpoint()
        (client, state), = list(ckpt.states())
        assert np.allclose(state["v"], ckpt.server["x"], rtol=1e-6, atol=1e-7)
        assert state["alpha"][0] == 1.0
    adaptive = merged(method("apfl"), system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "adaptive", adaptive) as r:
        alphas = [st["alpha"][0] for _, st in r.checkpoint().states()]
    assert alphas and all(0.0 <= a <= 1.0 for a in alphas) and any(a != 0.5 for a in alphas)


def test_pfedme_keeps_theta_and_scores_it(tmp_path):
    values = merged(method("pfedme"), system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "pfedme", values) as r:
        states = dict(r.checkpoint().states())
        table, trained = r.client_eval(), set(r.clients()["client"].tolist())
        x = r.checkpoint().server["x"]
    assert states and all(s["started"][0] == 1 and s["theta"].shape == x.shape
                          for s in states.values())
    last = table["round"] == TINY["rounds"]
    never = np.array([int(c) not in trained for c in table["client"][last]])
    personal, plain = table["personal_accuracy"][last], table["accuracy"][last]
    assert np.array_equal(personal[never], plain[never])
    assert not np.array_equal(personal[~never], plain[~never])


def _task(hidden=(6,)):
    torch.manual_seed(0)
    flat = FlatModel(build_model("mlp", 4, 3, 1, hidden=hidden))
    return ClientTask(client=0, data=None, model=flat, device=torch.device("cpu"))


def _batches(k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, 5, 4, generator=g), torch.randint(0, 3, (k, 5), generator=g)


@pytest.mark.parametrize("hessian", [False, True])
def test_per_fedavg_s_step_is_the_maml_gradient(hessian):
    """With D'' = D the Hessian-free step is the exact gradient of f(w - alpha grad f(w;
    D); D') (torch.func through the inner step); the first-order one drops the Hessian."""
    task, alpha = _task(), 0.3
    flat = task.model
    xs, ys = _batches(2, 1)
    w0 = flat.params.clone()
    xb, yb = (xs[0], xs[1], xs[0]), (ys[0], ys[1], ys[0])
    meta_gradient(task, xb, yb, cross_entropy, alpha, hessian)
    assert torch.equal(flat.params, w0)   # the parameters as they were

    names = [s.name for s in flat.layout]
    shapes = [s.shape for s in flat.layout]

    def loss_at(w, x, y):
        params, at = {}, 0
        for name, shape in zip(names, shapes):
            n = int(np.prod(shape))
            params[name] = w[at:at + n].view(shape)
            at += n
        return F.cross_entropy(torch.func.functional_call(flat.module, params, (x,)), y)

    def maml(w):
        inner = torch.func.grad(loss_at)(w, xs[0], ys[0])
        w_tmp = w - alpha * (inner if hessian else inner.detach())
        return loss_at(w_tmp, xs[1], ys[1])

    expected = torch.func.grad(maml)(w0)
    assert torch.allclose(flat.grads, expected, rtol=1e-5, atol=1e-6)


def test_per_fedavg_runs_both_variants_and_keeps_no_state(tmp_path):
    for variant in ("fo", "hf"):
        values = merged(method("perfedavg", variant=variant),
                        system={**TINY["system"], "checkpoint_every": 1},
                        eval={**SPLIT["eval"], "client_finetune_epochs": 1})
        with run_file(tmp_path, variant, values) as r:
            assert dict(r.checkpoint().states()) == {}
            assert np.isfinite(r.model()).all()
            assert np.isfinite(r.client_eval()["personal_accuracy"]).all()


def test_fedrod_sends_the_body_and_generic_head_and_scores_g_plus_p(tmp_path):
    """The personalised head (32 x 10 + 10 on TINY's CNN) stays on the clients; the global
    model keeps it at zero, so the global model predicts with G alone and a client never
    trained is scored on exactly that."""
    with run_file(tmp_path, "rod", method("fedrod")) as r:
        attrs, model, layout = r.attrs, r.model(), r.layout()
        table, trained = r.client_eval(), set(r.clients()["client"].tolist())
        up = set(r.clients()["bytes_up"])
    assert attrs["private_params"] == 330 and attrs["shared_params"] == attrs["num_params"] - 330
    assert up == {4 * attrs["shared_params"]}
    head = [(o, int(np.prod(s))) for n, s, o in layout if n.startswith("personal_head.")]
    assert all(not model[o:o + k].any() for o, k in head)
    last = table["round"] == TINY["rounds"]
    never = np.array([int(c) not in trained for c in table["client"][last]])
    personal, plain = table["personal_accuracy"][last], table["accuracy"][last]
    assert np.array_equal(personal[never], plain[never])
    assert not np.array_equal(personal[~never], plain[~never])


def test_fedala_starts_a_new_client_from_x_and_learns_weights_in_0_1(tmp_path):
    """A client's first participation trains from x^t as FedAvg's one client does (its
    theta is x^1 up to FedAvg's rounding of a mean of one); at its next participation
    the top layers' weights move from ones and stay in [0, 1], the lower ones unused."""
    one = merged(SPLIT, rounds=2, clients={**TINY["clients"], "per_round": 1},
                 system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "one", method("fedala", one)) as r:
        ckpt = r.checkpoint()
        (_, state), = list(ckpt.states())
        assert np.allclose(state["theta"], ckpt.server["x"], rtol=1e-6, atol=1e-7)
        assert (state["weights"] == 1).all() and state["started"][0] == 1
    again = merged(SPLIT, rounds=6, system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "again", method("fedala", again)) as r:
        states = [s for _, s in r.checkpoint().states() if s["started"][0] == 2]
    assert states
    for s in states:
        top, lower = s["weights"][-330:], s["weights"][:-330]
        assert (lower == 1).all() and ((0 <= top) & (top <= 1)).all() and (top < 1).any()


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", ["fedrod", "fedala"])
def test_fedrod_and_fedala_are_bitwise_the_same_for_1_and_3_ranks(tmp_path, name):
    values = merged(method(name), system=DETERMINISTIC, rounds=5)
    assert_same_on_3_ranks(tmp_path, values, client_eval=True)


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", ["apfl", "pfedme"])
def test_apfl_and_pfedme_are_bitwise_the_same_for_1_and_3_ranks(tmp_path, name):
    assert_same_on_3_ranks(tmp_path, merged(method(name), system=DETERMINISTIC),
                           client_eval=True)


@pytest.mark.parametrize("name", ["apfl", "pfedme", "fedala"])
def test_a_resumed_run_has_the_same_personal_scores(tmp_path, name):
    crashed, _ = run_and_resume(merged(method(name), system=DETERMINISTIC, rounds=4), tmp_path)
    with RunFile(tmp_path / "ref.h5") as ref, RunFile(crashed) as resumed:
        assert np.array_equal(ref.model(), resumed.model())
        for column, values in ref.client_eval().items():
            assert np.array_equal(values, resumed.client_eval()[column]), column


@pytest.mark.parametrize("over, message", [
    ({"algorithm": {"name": "apfl", "alpha": 1.5}}, "algorithm.alpha: must be in [0, 1], got 1.5"),
    ({"algorithm": {"name": "apfl"}, "train": {**TINY["train"], "local_schedule": "cosine"}},
     "train.local_schedule: 'cosine' is not allowed with apfl"),
    ({"algorithm": {"name": "pfedme", "lam": 0.0}}, "algorithm.lam: must be > 0, got 0.0"),
    ({"algorithm": {"name": "pfedme", "inner_steps": 0}},
     "algorithm.inner_steps: must be >= 1, got 0"),
    ({"algorithm": {"name": "perfedavg", "variant": "so"}},
     "algorithm.variant: 'so' is not allowed; choose one of fo, hf"),
    ({"algorithm": {"name": "perfedavg"}, "train": {**TINY["train"], "optimizer": "adam"}},
     "train.optimizer"),
    ({"algorithm": {"name": "fedala", "sample": 0.0}}, "algorithm.sample: must be in (0, 1], got 0.0"),
    ({"algorithm": {"name": "fedala", "window": 1}}, "algorithm.window: must be >= 2, got 1"),
    ({"algorithm": {"name": "fedrod"}, "system": {**TINY["system"], "client_group": 2},
      "train": {**TINY["train"], "optimizer": "adam"}},
     "system.client_group: train.optimizer 'adam' has no group form"),
    ({"algorithm": {"name": "fedala"}, "system": {**TINY["system"], "client_group": 2},
      "train": {**TINY["train"], "optimizer": "adam"}},
     "system.client_group: train.optimizer 'adam' has no group form"),
])
def test_what_the_methods_cannot_take_is_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(TINY, **over))


def test_a_per_fedavg_client_with_one_batch_takes_no_step(tmp_path):
    """B larger than any client's data: one batch an epoch, fewer than a meta-step takes:
    every client takes 0 steps, uploads zero, and the model stays the initial one."""
    from test_private_layers import initial_model

    values = merged(method("perfedavg", TINY), train={**TINY["train"], "batch_size": 512})
    with run_file(tmp_path, "one", values) as r:
        assert (r.clients()["steps"] == 0).all()
        assert np.array_equal(r.model(), initial_model(values))
