"""Local DP (``privacy.mechanism = "local"``; the LocalNoise client stage of
fedmpi.runtime.dp): without noise and with a clip that never binds it is FedAvg; its
Gaussian and Laplace noise have the stated scale; epsilon is dp-accounting's for one
client's rounds; what the server does after it (codecs, sampling by size) is allowed;
1 and 3 ranks agree bit for bit."""

import math
import re

import dp_accounting as dpa
import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi import privacy
from fedmpi.algorithms.base import Upload
from fedmpi.errors import UsageError
from fedmpi.runtime.dp import LocalNoise

from conftest import fedmpi, needs_mpi
from helpers import EQUAL_SIZES, TINY, assert_same_on_3_ranks, merged, run_file

BASE = EQUAL_SIZES
LOCAL = {"mechanism": "local", "clip": 1.0, "noise_multiplier": 1.0}


run = run_file   # (tmp_path, name, values) -> the finished run's file, open


def test_no_noise_and_a_clip_that_never_binds_is_fedavg_bit_for_bit(tmp_path):
    with run(tmp_path, "fedavg", BASE) as plain, \
            run(tmp_path, "local", merged(BASE, privacy={**LOCAL, "clip": 1e30,
                                                         "noise_multiplier": 0.0})) as private:
        assert np.array_equal(plain.model(), private.model())
        assert np.array_equal(plain.rounds()["test_acc"], private.rounds()["test_acc"],
                              equal_nan=True)
        assert np.array_equal(plain.rounds()["fl_bytes_up"], private.rounds()["fl_bytes_up"])


def test_the_clip_is_l2_for_gaussian_noise_and_l1_for_laplace():
    def clipped(noise):
        config = cfg.from_dict(merged(BASE, privacy={**LOCAL, "clip": 0.5, "noise_multiplier": 0.0,
                                                     "local_noise": noise}))
        up = Upload(delta=torch.tensor([3.0, -4.0]), num_samples=7, loss=0.0, steps=1)
        return LocalNoise(config).upload(up, None, (0, 0, 0))[0].delta.tolist()
    assert clipped("gaussian") == pytest.approx([0.3, -0.4])        # ||.||_2 = 5
    assert clipped("laplace") == pytest.approx([3 / 14, -4 / 14])   # ||.||_1 = 7


@pytest.mark.parametrize("noise, mean_abs_over_std", [("gaussian", math.sqrt(2 / math.pi)),
                                                      ("laplace", 1 / math.sqrt(2))])
def test_one_client_a_round_moves_the_model_by_its_noise(tmp_path, noise, mean_abs_over_std):
    """One client a round whose update is ~0 (lr 1e-30): FedAvg's mean is that client's
    noised update, so the model moves by the noise alone: std sigma C (Gaussian) or
    sqrt(2) sigma C (Laplace of scale sigma C), and E|x| / std tells the two apart. With
    d = 84k coordinates each check fails by chance with probability ~1e-9."""
    still = merged(BASE, rounds=1, clients={"num": 12, "per_round": 1},
                   train={**TINY["train"], "lr": 1e-30}, model={**TINY["model"], "hidden": 4096})
    quiet = merged(still, privacy={**LOCAL, "noise_multiplier": 0.0, "local_noise": noise})
    noisy = merged(still, privacy={**LOCAL, "clip": 0.5, "noise_multiplier": 2.0,
                                   "local_noise": noise})
    with run(tmp_path, "quiet", quiet) as a, run(tmp_path, "noisy", noisy) as b:
        moved = (b.model() - a.model()).astype(np.float64)
        attrs = b.attrs
    d, scale = moved.size, 2.0 * 0.5
    want = scale * (math.sqrt(2) if noise == "laplace" else 1.0)
    assert d > 50_000
    assert abs(moved.std() / want - 1) < 12 / math.sqrt(2 * d)
    assert abs(np.abs(moved).mean() / moved.std() / mean_abs_over_std - 1) < 0.03
    assert attrs["privacy_local_noise"] == noise and attrs["privacy_mechanism"] == "local"


@pytest.mark.parametrize("noise, event", [("gaussian", dpa.GaussianDpEvent),
                                          ("laplace", dpa.LaplaceDpEvent)])
def test_epsilon_is_one_client_s_rounds_composed_by_dp_accounting(tmp_path, noise, event):
    """Any two updates differ by at most 2C: the event at sensitivity 1 has multiplier
    sigma / 2; a client in every round composes it t times (no amplification)."""
    with run(tmp_path, "run", merged(BASE, rounds=3, privacy={**LOCAL, "noise_multiplier": 4.0,
                                                              "local_noise": noise})) as r:
        got, attrs = r.rounds()["epsilon"][1:].tolist(), r.attrs
    delta = 1 / 12 ** 1.1
    want = []
    for t in (1, 2, 3):
        accountant = dpa.rdp.RdpAccountant()
        accountant.compose(event(2.0), t)
        want.append(accountant.get_epsilon(delta))
    assert got == want and attrs["privacy_local_epsilon_per_round"] == want[0]
    assert attrs["privacy_accountant"] == "dp-accounting RDP"
    if noise == "laplace":   # pure epsilon 2C / (sigma C) a round bounds it
        assert want[2] <= 3 * 2 / 4.0


def test_what_follows_the_noise_is_post_processing_and_allowed(tmp_path):
    values = merged(BASE, privacy=LOCAL, compression={"up": "qsgd"},
                    clients={"num": 12, "per_round": 4, "sampling": "size"})
    with run(tmp_path, "run", values) as r:
        assert np.isfinite(r.model()).all() and r.status == "completed"


def test_auto_accounts_with_rdp_where_a_pld_would_explode():
    wide = merged(BASE, clients={"num": 3000, "per_round": 300, "sampling": "bernoulli"},
                  data={**TINY["data"], "num_train": 6000})
    small = cfg.from_dict(merged(wide, privacy={"mechanism": "central", "noise_multiplier": 0.05,
                                                "delta": 1e-5}))
    large = cfg.from_dict(merged(wide, privacy={"mechanism": "central", "noise_multiplier": 1.0,
                                                "delta": 1e-5}))
    assert privacy.accountant_of(small) == "rdp" and privacy.accountant_of(large) == "pld"
    assert privacy.describe(small)["privacy_accountant"] == "dp-accounting RDP"


@pytest.mark.slow
@needs_mpi
def test_local_runs_are_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    assert_same_on_3_ranks(tmp_path, merged(BASE, privacy={**LOCAL, "local_noise": "laplace"}), ["epsilon"])


@pytest.mark.parametrize("over, message", [
    ({"algorithm": {"name": "scaffold"}},
     "privacy.mechanism: local DP clips and noises each client's delta, all it may upload, "
     "FedAvg's server side; 'scaffold' has its own"),
    ({"privacy": {**LOCAL, "audit_canaries": 10}},
     "privacy.audit_canaries: needs privacy.mechanism = \"central\""),
    ({"privacy": {**LOCAL, "clip_quantile": 0.5}},
     "privacy.clip_quantile: needs privacy.mechanism = \"central\""),
    ({"privacy": {**LOCAL, "local_noise": "uniform"}}, "privacy.local_noise"),
])
def test_what_local_dp_cannot_do_is_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(BASE, **{"privacy": LOCAL, **over}))


def test_the_privacy_command_says_what_a_client_spends(tmp_path):
    out = fedmpi(["privacy", "--set", "privacy.mechanism=\"local\"", "--set",
                  "privacy.noise_multiplier=4", "--set", "rounds=10"])
    assert out.returncode == 0, out.stderr
    head, spent = out.stdout.strip().splitlines()
    assert head.startswith("local DP, each client's update clipped to 1 and noised with "
                           "gaussian noise, 10 rounds")
    assert "epsilon (a client in every round)" in spent
