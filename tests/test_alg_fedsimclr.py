"""FedSimCLR end to end: two-view SimCLR clients, FedAvg, and the kNN monitor sharded over
workers, bitwise equal to one process and to an unsharded kNN of the final encoder."""

import sys

import numpy as np
import pytest
import torch

from fedmpi import config as cfgmod
from fedmpi.data import load_dataset
from fedmpi.models import build_model
from fedmpi.results import RunFile
from fedmpi.evaluation.ssl import features, knn_predict

from conftest import fedmpi, mpirun, needs_mpi
from helpers import write_config

SSL = {
    "name": "ssl", "seed": 3, "rounds": 2,
    # 9,000 training images = three kNN bank chunks of 4,096, so two workers share the bank
    "data": {"dataset": "synthetic", "num_train": 9000, "num_test": 300, "size": 16},
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "clients": {"num": 6, "per_round": 3},
    "model": {"name": "cnn", "hidden": 32, "channels": [4, 8]},
    "algorithm": {"name": "fedsimclr", "proj_dim": 16, "proj_hidden": 32},
    "train": {"batch_size": 64, "lr": 0.05},
    "system": {"deterministic": True, "device": "cpu"},
}


def final_encoder(run: RunFile, config) -> torch.nn.Module:
    from fedmpi.algorithms import build
    alg = build(config.algorithm.name, config.algorithm.params)
    module = alg.build_model(build_model, config.model.name, 1, 10, 16, config.model.options)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in run.state_dict().items()})
    return module.encoder


@pytest.mark.slow
@needs_mpi
def test_mpirun_is_bitwise_single_process_and_knn_is_the_unsharded_one(tmp_path):
    config = write_config(tmp_path / "ssl.toml", SSL)
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "single.h5")], check=True)
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(tmp_path / "n3.h5")])
    with RunFile(tmp_path / "single.h5") as a, RunFile(tmp_path / "n3.h5") as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"])   # round 0's kNN too
        assert np.array_equal(a.rounds()["train_loss"], b.rounds()["train_loss"], equal_nan=True)
        d = len(b.model())
        assert b.rounds()["fl_bytes_down"].tolist() == [0] + [3 * d * 4] * 2  # round 0: none
        c = cfgmod.from_dict(b.config)
        encoder = final_encoder(b, c)
        ds = load_dataset("synthetic", seed=3, num_train=9000, num_test=300, size=16)
        prepare = lambda x: (x.float() / 255 - ds.mean[0]) / ds.std[0]  # noqa: E731
        bank = features(encoder, ds.train_x, prepare, normalize=True)
        test = features(encoder, ds.test_x, prepare, normalize=True)
        expected = float((knn_predict(test, bank, ds.train_y, 10) == ds.test_y).double().mean())
        assert abs(b.rounds()["test_acc"][-1] - expected) < 1e-12
        assert np.isnan(b.rounds()["test_loss"]).all()  # no classifier, no test loss


@pytest.mark.slow
def test_simclr_clients_learn_on_real_digits(tmp_path):
    """NT-Xent starts at chance, log(2B - 1), and falls on MNIST-5k within a few rounds."""
    values = dict(SSL, data={"dataset": "mnist5k"}, rounds=4, model={"name": "cnn", "hidden": 128},
                  algorithm={"name": "fedsimclr", "proj_dim": 64, "proj_hidden": 128},
                  clients={"num": 4, "per_round": 4}, system={"deterministic": False},
                  eval={"at_start": False})   # losses of rounds 1-4 only
    config = write_config(tmp_path / "digits.toml", values)
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "d.h5")], check=True)
    with RunFile(tmp_path / "d.h5") as run:
        loss, acc = run.rounds()["train_loss"], run.rounds()["test_acc"]
    assert loss[0] > loss[-1] and loss[-1] < np.log(2 * 64 - 1) - 0.2
    assert acc[-1] > 0.7  # kNN on MNIST-5k features (chance 0.1)
