"""FedNTD (fedmpi.algorithms.fedntd) and FedLC (fedmpi.algorithms.fedlc): their losses
by hand, local steps against plain-torch references, the reductions to FedAvg (beta = 0,
tau = 0) bit for bit, the per-client label counts, real runs through the runtime and the
refusals of bad parameters."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfg
from fedmpi.algorithms import REGISTRY, build, message_sizes
from fedmpi.algorithms.base import ClientData, ClientTask
from fedmpi.algorithms.fedlc import calibration
from fedmpi.algorithms.fedntd import not_true, ntd_loss
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile
from fedmpi.runtime.clientdata import DeviceData

from harness import context
from helpers import TINY, merged
from test_runtime import run_tiny

C = 5   # classes of the tiny model


class Batches(ClientData):
    """Fixed batches, and their label counts (what TensorClientData counts)."""

    def __init__(self, batches):
        self.items, self.num_samples = batches, sum(len(y) for _, y in batches)

    def batches(self, epochs, batch_size):
        yield from self.items * epochs

    def label_counts(self, num_classes):
        y = torch.cat([y for _, y in self.items])
        return torch.bincount(y, minlength=num_classes)


def make_task(labels=((0, 1, 2, 4),), channels_last=True):
    torch.manual_seed(1)
    module = build_model("cnn", 3, C, 16, hidden=12, channels=[2, 3])
    flat = FlatModel(module, channels_last=channels_last)
    gen = torch.Generator().manual_seed(2)
    data = Batches([(torch.randn(len(y), 3, 16, 16, generator=gen), torch.tensor(y))
                    for y in labels])
    return ClientTask(0, data, flat, torch.device("cpu")), gen


def module_at(flat, vec):
    """A plain module with standard-layout weights from a storage-order vector."""
    torch.manual_seed(1)
    m = build_model("cnn", 3, C, 16, hidden=12, channels=[2, 3])
    m.load_state_dict(flat.state_dict_of(vec))
    return m


def step_by_hand(module, loss, lr):
    """The module after w <- w - lr grad(loss) (plain SGD, no decay, no clipping)."""
    module.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            p.sub_(lr * p.grad)


def assert_module_is(flat, module):
    after = flat.state_dict_of(flat.params)
    for name, p in module.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), rtol=1e-5, atol=1e-6)


# ---- FedNTD ---------------------------------------------------------------------------

def test_not_true_logits_drop_the_label_and_keep_the_class_order():
    z = torch.arange(12.0).view(3, 4)
    y = torch.tensor([0, 2, 3])
    assert torch.equal(not_true(z, y), torch.tensor([[1.0, 2, 3], [4, 5, 7], [8, 9, 10]]))


def test_ntd_loss_by_hand():
    gen = torch.Generator().manual_seed(0)
    z, zg = torch.randn(3, C, generator=gen), torch.randn(3, C, generator=gen)
    y, tau = torch.tensor([1, 0, 4]), 2.0
    total = 0.0
    for b in range(3):
        keep = [c for c in range(C) if c != y[b]]
        q = [math.exp(z[b, c] / tau) for c in keep]
        p = [math.exp(zg[b, c] / tau) for c in keep]
        q = [v / sum(q) for v in q]
        p = [v / sum(p) for v in p]
        total += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert math.isclose(ntd_loss(z, zg, y, tau).item(), total / 3, rel_tol=1e-5)
    assert ntd_loss(z, z, y, tau).abs().item() < 1e-6   # the teacher itself: 0


def test_fedntd_beta_zero_is_fedavg_bitwise():
    task, _ = make_task(labels=((0, 1, 2, 4), (3, 3, 1, 0)))
    x = task.model.params.detach().clone()
    ntd = build("fedntd", {"beta": 0.0}).local_update(task, {"x": x}, None, context(lr=0.05))
    avg = build("fedavg", {}).local_update(task, {"x": x}, None, context(lr=0.05))
    assert torch.equal(ntd.delta, avg.delta) and ntd.loss == avg.loss
    assert ntd.num_samples == avg.num_samples and ntd.steps == avg.steps
    default = build("fedntd", {}).local_update(task, {"x": x}, None, context(lr=0.05))
    assert (default.delta - avg.delta).abs().max() > 1e-5   # the second step's distillation


def test_fedntd_two_local_steps_match_a_hand_written_reference():
    """Two steps: at the first the student is the teacher (the KL and its gradient are
    0), at the second the not-true distillation pulls towards the frozen x^t."""
    beta, tau, lr = 3.0, 2.0, 0.5
    task, _ = make_task(labels=((0, 1, 2, 4), (3, 3, 1, 0)))
    flat = task.model
    x = flat.params.detach().clone()
    upload = build("fedntd", {"beta": beta, "tau": tau}).local_update(
        task, {"x": x}, None, context(lr=lr))

    local, glob = module_at(flat, x), module_at(flat, x)
    losses = []
    for xb, yb in task.data.items:
        z = local(xb)
        with torch.no_grad():
            zg = glob(xb)
        ce = F.cross_entropy(z, yb)
        keep = torch.stack([torch.tensor([c for c in range(C) if c != t]) for t in yb])
        q = F.log_softmax(z.gather(1, keep) / tau, dim=1)
        p = F.softmax(zg.gather(1, keep) / tau, dim=1)
        loss = ce + beta * (p * (p.log() - q)).sum(1).mean()
        losses.append(loss.item())
        step_by_hand(local, loss, lr)
    assert losses[0] == pytest.approx(F.cross_entropy(glob(task.data.items[0][0]),
                                                      task.data.items[0][1]).item(), rel=1e-5)
    assert_module_is(flat, local)
    assert upload.loss == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert upload.steps == 2 and torch.equal(upload.delta, flat.params - x)
    assert upload.state is None
    task.model.load(x)
    ce_only = build("fedavg", {}).local_update(task, {"x": x}, None, context(lr=lr))
    assert (upload.delta - ce_only.delta).abs().max() > 1e-4   # the reference is not CE's


# ---- FedLC ----------------------------------------------------------------------------

def test_calibration_of_present_absent_and_clamped_classes():
    counts = torch.tensor([16, 1, 0, 81])
    m = calibration(counts, 0.5)
    assert m[:2].tolist() == [0.25, 0.5] and m[3].item() == pytest.approx(0.5 / 3)
    assert math.isinf(m[2].item())
    clamped = calibration(counts, 0.5, "clamp")
    assert clamped[2].item() == pytest.approx(50.0)
    assert torch.equal(clamped[[0, 1, 3]], m[[0, 1, 3]])


def test_fedlc_tau_zero_is_fedavg_bitwise():
    task, _ = make_task()   # class 3 absent: tau * inf would be NaN at tau = 0
    x = task.model.params.detach().clone()
    lc = build("fedlc", {"tau": 0.0}).local_update(task, {"x": x}, None, context(lr=0.05))
    avg = build("fedavg", {}).local_update(task, {"x": x}, None, context(lr=0.05))
    assert torch.equal(lc.delta, avg.delta) and lc.loss == avg.loss
    default = build("fedlc", {}).local_update(task, {"x": x}, None, context(lr=0.05))
    assert not torch.equal(default.delta, avg.delta)


@pytest.mark.parametrize("absent", ["exclude", "clamp"])
def test_fedlc_local_step_matches_a_hand_written_reference(absent):
    """Labels 0, 1, 1, 4 of 5 classes: n = (1, 2, 0, 0, 1); classes 2 and 3 are absent."""
    tau, lr = 0.7, 0.1
    task, _ = make_task(labels=((0, 1, 1, 4),))
    flat = task.model
    x = flat.params.detach().clone()
    upload = build("fedlc", {"tau": tau, "absent": absent}).local_update(
        task, {"x": x}, None, context(lr=lr))

    local = module_at(flat, x)
    xb, yb = task.data.items[0]
    n = [1, 2, 0, 0, 1]
    z = local(xb)
    terms = []
    for b in range(4):
        classes = range(C) if absent == "clamp" else [c for c in range(C) if n[c] > 0]
        cal = {c: z[b, c] - tau * max(n[c], 1e-8) ** -0.25 for c in classes}
        terms.append(-(cal[int(yb[b])] - torch.logsumexp(torch.stack(list(cal.values())), 0)))
    loss = torch.stack(terms).mean()
    step_by_hand(local, loss, lr)
    assert all(torch.isfinite(p.grad).all() for p in local.parameters())
    assert_module_is(flat, local)
    assert upload.loss == pytest.approx(loss.item(), rel=1e-5)
    assert torch.isfinite(upload.delta).all() and upload.state is None


def test_client_label_counts_come_from_its_own_indices_once():
    gen = torch.Generator().manual_seed(0)
    n = 70_000   # more than the 2^16 labels compared at a time
    train_y = torch.randint(0, 4, (n,), generator=gen)
    dataset = SimpleNamespace(train_x=torch.zeros(n, 1, 2, 2, dtype=torch.uint8),
                              train_y=train_y, test_x=torch.zeros(0, 1, 2, 2, dtype=torch.uint8),
                              test_y=torch.zeros(0, dtype=torch.int64), mean=(0.0,), std=(1.0,))
    data = DeviceData(dataset, torch.device("cpu"), augment=False, crop_padding=0, flip=False,
                      channels_last=False)
    indices = np.array([3, 7, 7, 20, 41, 49])
    client = data.client(indices, seed=0, round_=1, client=2, phase=0)
    counts = client.label_counts(6)
    want = np.bincount(train_y.numpy()[indices], minlength=6)
    assert counts.tolist() == want.tolist() and counts.dtype == torch.int64
    assert client.label_counts(6) is counts   # counted once per client object
    assert client.label_counts(7).tolist() == want.tolist() + [0]
    everyone = data.client(np.arange(n), seed=0, round_=1, client=3, phase=0)
    assert everyone.label_counts(4).tolist() == np.bincount(train_y.numpy()).tolist()
    with pytest.raises(NotImplementedError):
        ClientData().label_counts(3)


# ---- both: declarations, real runs, refusals ------------------------------------------

def test_declared_messages_and_no_state():
    for name in ("fedntd", "fedlc"):
        assert message_sizes(REGISTRY[name]) == "down d, up d"
        assert build(name, {}).client_state_sizes(7) == {}
        assert not REGISTRY[name].trains_in_groups()
    assert build("fedntd", {}).params.tau == 1.0 and build("fedntd", {}).params.beta == 1.0
    assert build("fedlc", {}).params.tau == 1.0 and build("fedlc", {}).params.absent == "exclude"


SMALL = merged(TINY, rounds=2, clients={"num": 6, "per_round": 4}, system={"deterministic": True})
CASES = {"fedntd": {"name": "fedntd"}, "fedlc": {"name": "fedlc"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-round runs of FedAvg, of each method with its defaults and of each reduction."""
    tmp = tmp_path_factory.mktemp("runs")
    algorithms = {"fedavg": {"name": "fedavg"}, **CASES,
                  "fedntd_beta0": {"name": "fedntd", "beta": 0.0},
                  "fedlc_tau0": {"name": "fedlc", "tau": 0.0}}
    out = {}
    for name, algorithm in algorithms.items():
        c, exp, run = run_tiny(tmp, name, base=merged(SMALL, algorithm=algorithm))
        run.close()
        out[name] = (c, exp)
    return out


@pytest.mark.parametrize("name", CASES)
def test_real_run_completes_with_d_down_and_d_up_per_client(runs, name):
    c, exp = runs[name]
    with RunFile(c.output_path()) as run:
        rounds = run.rounds()
        assert run.status == "completed"
        per_client = exp.d * 4
        assert rounds["fl_bytes_down"].tolist() == [0] + [4 * per_client] * 2   # 0: round 0
        assert rounds["fl_bytes_up"].tolist() == [0] + [4 * per_client] * 2
        assert np.all(run.clients()["bytes_up"] == per_client)
        assert np.all(np.isfinite(rounds["train_loss"][1:]))
        assert run.config["algorithm"] == {**CASES[name], **dataclasses.asdict(exp.alg.params)}
        assert len(exp.store) == 0   # no client state


@pytest.mark.parametrize("name,reduced", [("fedntd", "fedntd_beta0"), ("fedlc", "fedlc_tau0")])
def test_real_run_reduces_to_fedavg_and_differs_otherwise(runs, name, reduced):
    with RunFile(runs["fedavg"][0].output_path()) as avg, \
            RunFile(runs[reduced][0].output_path()) as zero, \
            RunFile(runs[name][0].output_path()) as method:
        assert np.array_equal(zero.model(), avg.model())
        assert not np.array_equal(method.model(), avg.model())


@pytest.mark.parametrize("name,params,field", [
    ("fedntd", {"tau": 0.0}, "algorithm.tau"),
    ("fedntd", {"tau": -1.0}, "algorithm.tau"),
    ("fedntd", {"beta": -0.1}, "algorithm.beta"),
    ("fedntd", {"beta": "big"}, "algorithm.beta"),
    ("fedlc", {"tau": -0.5}, "algorithm.tau"),
    ("fedlc", {"absent": "zero"}, "algorithm.absent")])
def test_bad_parameters_raise_a_one_line_usage_error_naming_the_field(name, params, field):
    with pytest.raises(UsageError, match=f"^config field {field}: ") as err:
        build(name, params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", CASES)
def test_config_refuses_them_in_client_groups(name):
    with pytest.raises(UsageError, match="system.client_group") as err:
        cfg.from_dict(merged(SMALL, algorithm=CASES[name], system={"client_group": 2}))
    assert name in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UsageError, match="^config field algorithm.tau: must be"):
        cfg.from_dict(merged(SMALL, algorithm={**CASES[name], "tau": -1.0}))


@pytest.mark.parametrize("name,params", [("fedntd", {}), ("fedlc", {}),
                                         ("fedlc", {"absent": "clamp"})])
def test_bf16_autocast_trains_to_a_finite_update(name, params):
    """The -inf of an absent class and the teacher's forward under autocast (emulated on
    a CPU without bf16, the loop a GPU runs with system.precision = "bf16")."""
    task, _ = make_task(labels=((0, 1, 2, 4), (3, 3, 1, 0)))
    task.autocast = torch.bfloat16
    x = task.model.params.detach().clone()
    upload = build(name, params).local_update(task, {"x": x}, None, context(lr=0.1))
    assert math.isfinite(upload.loss) and torch.isfinite(upload.delta).all()
    assert upload.delta.abs().max() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_cuda_run_completes(tmp_path, name, precision):
    """On a GPU: the counts on the device, the teacher's copy, bf16 autocast."""
    c, _, run = run_tiny(tmp_path, f"{name}-{precision}",
                         base=merged(SMALL, algorithm=CASES[name], rounds=1,
                                     system={"device": "cuda", "precision": precision}))
    with run:
        assert run.status == "completed"
        assert np.all(np.isfinite(run.rounds()["train_loss"][1:]))
