"""User-level central DP (``[privacy]``, fedmpi.runtime.dp, fedmpi.privacy): it reduces to
FedAvg without noise and a clip that never binds; its noise has the stated std; epsilon is
dp-accounting's, after every round, continued by a resume; 1 and 3 ranks agree bit for bit;
what the accounting cannot cover is refused with one line."""

import math
import sys

import dp_accounting as dpa
import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi import privacy
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime.dp import ClipUpdate
from fedmpi.algorithms.base import Upload

from conftest import fedmpi, mpirun, needs_mpi
from helpers import TINY, merged, run_and_resume, run_file, write_config

# 12 clients of exactly 32 samples (a power of two: n_i Delta_i and Delta_i sum to the
# same bits up to that factor), 4 a round drawn uniformly (the count is S every round)
BASE = {**TINY, "partition": {"kind": "iid"}}
EQUAL = dict(data={**TINY["data"], "num_train": 384}, clients={"num": 12, "per_round": 4},
             rounds=2, system={"deterministic": True})
CENTRAL = {"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0}


def values(**privacy_section):
    return merged(BASE, **EQUAL, privacy={**CENTRAL, **privacy_section})


run = run_file   # (tmp_path, name, values) -> the finished run's file, open


def test_the_clip_scales_an_update_to_the_bound_and_weighs_it_once():
    stage = ClipUpdate(0.5)
    up = Upload(delta=torch.tensor([3.0, 4.0]), num_samples=7, loss=0.0, steps=1)
    up, state = stage.upload(up, None, (0, 0, 0))
    assert state == {} and up.delta.tolist() == pytest.approx([0.3, 0.4])
    contribution = stage.contribute({"delta": up.delta * 7, "weight": torch.tensor([7.0])}, up, {})
    assert contribution["delta"].tolist() == pytest.approx([0.3, 0.4])
    assert contribution["weight"].tolist() == [1.0]
    small = ClipUpdate(10.0).upload(Upload(delta=torch.tensor([3.0, 4.0]), num_samples=1,
                                           loss=0.0, steps=1), None, (0, 0, 0))[0]
    assert small.delta.tolist() == [3.0, 4.0]   # within the bound: unchanged, bit for bit


def test_no_noise_and_a_clip_that_never_binds_is_fedavg_bit_for_bit(tmp_path):
    with run(tmp_path, "fedavg", merged(BASE, **EQUAL)) as plain, \
            run(tmp_path, "dp", values(clip=1e30, noise_multiplier=0.0)) as private:
        assert np.array_equal(plain.model(), private.model())
        for name in ("test_acc", "test_loss", "train_loss"):
            assert np.array_equal(plain.rounds()[name], private.rounds()[name], equal_nan=True)
        assert np.all(np.isinf(private.rounds()["epsilon"][1:]))
        assert "epsilon" not in plain.rounds()


def test_the_noise_on_the_mean_has_std_sigma_clip_over_S(tmp_path):
    """Clients whose updates are ~0 (lr 1e-30): the model moves by the noise / S alone.
    With d coordinates the sample std is within 6 / sqrt(2 d) of the truth except with
    chance ~2e-9 (a normal approximation of the chi-square), the mean within 6 std/sqrt(d)."""
    still = {**EQUAL, "train": {**TINY["train"], "lr": 1e-30}, "rounds": 1,
             "model": {**TINY["model"], "hidden": 4096}}   # d = 84k
    quiet = merged(BASE, **still, privacy={**CENTRAL, "noise_multiplier": 0.0})
    noisy = merged(BASE, **still, privacy={**CENTRAL, "clip": 0.5, "noise_multiplier": 2.0})
    with run(tmp_path, "quiet", quiet) as a, run(tmp_path, "noisy", noisy) as b:
        moved = (b.model() - a.model()).astype(np.float64)
        attrs = b.attrs
    d, want = moved.size, 2.0 * 0.5 / 4
    assert d > 50_000
    assert abs(moved.std() / want - 1) < 6 / math.sqrt(2 * d)
    assert abs(moved.mean()) < 6 * want / math.sqrt(d)
    assert attrs["privacy_noise_multiplier"] == 2.0 and attrs["privacy_clip"] == 0.5
    assert attrs["privacy_accountant"] == "dp-accounting RDP"


def test_epsilon_after_every_round_is_dp_accounting_s_and_a_resume_continues_it(tmp_path):
    path, _ = run_and_resume(values(noise_multiplier=1.5) | {"rounds": 3}, tmp_path)
    delta = 1 / 12 ** 1.1
    want = []
    for t in (1, 2, 3):
        accountant = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        accountant.compose(dpa.SampledWithoutReplacementDpEvent(12, 4, dpa.GaussianDpEvent(1.5)), t)
        want.append(accountant.get_epsilon(delta))
    with RunFile(tmp_path / "ref.h5") as ref, RunFile(path) as resumed:
        assert ref.rounds()["epsilon"][1:].tolist() == want
        assert np.array_equal(ref.rounds()["epsilon"], resumed.rounds()["epsilon"], equal_nan=True)
        assert np.array_equal(ref.model(), resumed.model())
        assert resumed.attrs["privacy_delta"] == delta


def test_poisson_accounting_is_the_pld_of_dp_accounting_called_directly():
    c = cfg.from_dict(merged(clients={"num": 3000, "per_round": 300, "sampling": "bernoulli"},
                             data={**TINY["data"], "num_train": 6000}, rounds=10,
                             privacy={**CENTRAL, "delta": 1e-5}))
    assert privacy.accountant_of(c) == "pld"
    accountant = dpa.pld.PLDAccountant(value_discretization_interval=privacy.PLD_GRID)
    accountant.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 10)
    assert privacy.epsilon(c, 10) == accountant.get_epsilon(1e-5)


@pytest.mark.slow
def test_a_target_epsilon_is_resolved_into_the_noise_that_reaches_it():
    c = cfg.from_dict(values(target_epsilon=4.0, noise_multiplier=0.0) | {"rounds": 20})
    sigma = c.privacy.noise_multiplier
    assert sigma > 0 and privacy.epsilon(c, 20) <= 4.0 + 1e-9
    assert privacy.epsilon(c, 20, sigma * 0.99) > 4.0   # the smallest, to the tolerance
    assert cfg.from_dict(c.to_dict()).privacy.noise_multiplier == sigma   # a resume's re-read


@pytest.mark.slow
@needs_mpi
def test_private_runs_are_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    config = write_config(tmp_path / "dp.toml", BASE, **EQUAL, privacy=CENTRAL)
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
               str(tmp_path / "n3.h5")])
    with run(tmp_path, "one", values()) as a, RunFile(tmp_path / "n3.h5") as b:
        assert np.array_equal(a.model(), b.model())
        for name in ("test_acc", "epsilon"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)


@pytest.mark.parametrize("over, message", [
    ({"privacy": {**CENTRAL, "clip": 0.0}}, "privacy.clip: must be a finite number > 0"),
    ({"privacy": {**CENTRAL, "noise_multiplier": -1.0}}, "privacy.noise_multiplier: must be >= 0"),
    ({"privacy": {**CENTRAL, "delta": 1.0}}, "privacy.delta: must be in (0, 1)"),
    ({"privacy": {**CENTRAL, "target_epsilon": -4.0}}, "privacy.target_epsilon: must be > 0"),
    ({"privacy": {**CENTRAL, "mechanism": "secure"}}, "privacy.mechanism"),
    ({"privacy": {**CENTRAL, "local_noise": "uniform"}}, "privacy.local_noise"),
    ({"privacy": {**CENTRAL, "noise_multiplier": 0.05, "accountant": "pld"},
      "clients": {"num": 3000, "per_round": 300, "sampling": "bernoulli"}},
     "privacy.accountant: \"pld\" at noise multiplier 0.05 (below 0.1) takes minutes"),
    ({"privacy": {**CENTRAL, "accountant": "pld"}}, "privacy.accountant: \"pld\" accounts for "
                                                    "Poisson sampling"),
    ({"privacy": CENTRAL, "algorithm": {"name": "scaffold"}},
     "privacy.mechanism: user-level DP clips and noises the mean of the client deltas, "
     "FedAvg's server side; 'scaffold' has its own; use one of"),
    ({"privacy": CENTRAL, "algorithm": {"name": "fedu2"}}, "'fedu2' has its own"),
    ({"privacy": CENTRAL, "compression": {"up": "qsgd"}}, "compression.up: privacy.mechanism "
                                                          "'central': a codec after the clip"),
    ({"privacy": CENTRAL, "clients": {"num": 12, "per_round": 4, "sampling": "size"}},
     "clients.sampling: privacy.mechanism 'central': the accounting needs Poisson"),
    ({"privacy": CENTRAL, "clients": {"num": 12, "per_round": 4, "sampling": "bernoulli"}},
     "clients.per_round: privacy.mechanism 'central': with q = 4/12 a Bernoulli draw is empty"),
    ({"privacy": CENTRAL, "clients": {"num": 12, "per_round": 4, "sampling": "bernoulli",
                                      "empty_rounds": "skip"}},
     "clients.empty_rounds: privacy.mechanism 'central': an empty round"),
    ({"privacy": CENTRAL, "system_model": {"profiles": "lognormal"}},
     "system_model.profiles: privacy.mechanism 'central': availability, deadlines"),
    ({"privacy": CENTRAL, "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 0}},
     "partition.min_size: privacy.mechanism 'central': clients without samples"),
])
def test_what_the_accounting_cannot_cover_is_refused(over, message):
    with pytest.raises(UsageError, match=__import__("re").escape(message)):
        cfg.from_dict(merged(BASE, **{**EQUAL, **over}))


def test_a_refusal_is_one_line_exit_2_and_no_file(tmp_path):
    out = tmp_path / "run.h5"
    path = write_config(tmp_path / "bad.toml", BASE, **EQUAL, privacy={**CENTRAL, "clip": -1.0},
                        output=str(out))
    proc = fedmpi(["run", str(path), "-q"])
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        "fedmpi: config field privacy.clip: must be a finite number > 0 (the L2 norm each "
        "update is clipped to), got -1.0"]


@pytest.mark.slow
def test_the_privacy_command_says_what_a_config_spends_and_what_a_target_needs(tmp_path):
    over = ["--set", "clients.num=3000", "--set", "clients.per_round=300", "--set",
            "clients.sampling=\"bernoulli\"", "--set", "rounds=100", "--set",
            "privacy.noise_multiplier=1.0", "--set", "privacy.delta=1e-5"]
    spent = fedmpi(["privacy", *over])
    assert spent.returncode == 0, spent.stderr
    c = cfg.from_dict(cfg.apply_overrides(cfg.load_preset("default"), [o for o in over if o != "--set"]))
    lines = spent.stdout.strip().splitlines()
    assert lines[0].startswith("user-level DP, a Gaussian mechanism on 300 of 3000 clients a "
                               "round (Poisson, q = 0.1), 100 rounds, delta = 1e-05, "
                               "dp-accounting PLD")
    assert lines[1].endswith(f"{privacy.epsilon(c, 100):.4g} after 100 rounds")
    target = fedmpi(["privacy", *over, "--epsilon", "4"])
    sigma = float(target.stdout.split("rounds: ")[1].split()[0])
    assert privacy.epsilon(c, 100, sigma) <= 4.0 + 1e-3 < privacy.epsilon(c, 100, sigma * 0.99)
    bad = fedmpi(["privacy", "--set", "clients.sampling=\"size\""])
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "fedmpi: config field clients.sampling: the accounting needs Poisson (\"bernoulli\") or "
        "fixed-size (\"uniform\") sampling, not \"size\"")


def test_a_published_figure_opacus_s_2_39_at_q_0_01_sigma_1_300_steps():
    """Opacus's compute_dp_sgd_privacy documents epsilon = 2.39 at delta = 1e-5 for the
    sampled Gaussian mechanism with q = 1%, sigma = 1.0, 300 steps, RDP orders
    {2, 5, 10, 20, 100}. fedmpi's event for a run of that shape (a client is an example,
    a round a step), composed over those orders, gives the figure; fedmpi's own epsilon,
    with dp-accounting's finer orders, is tighter."""
    c = cfg.from_dict(merged(clients={"num": 10_000, "per_round": 100, "sampling": "bernoulli"},
                             data={**TINY["data"], "num_train": 20_000}, rounds=300,
                             privacy={**CENTRAL, "delta": 1e-5, "accountant": "rdp"}))
    accountant = dpa.rdp.RdpAccountant(orders=[2, 5, 10, 20, 100])
    accountant.compose(privacy.round_event(c), 300)
    assert round(accountant.get_epsilon(1e-5), 2) == 2.39
    assert 1.0 < privacy.epsilon(c, 300) < 2.39
