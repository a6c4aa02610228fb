"""Real mpirun at 2, 3 and 4 ranks against the single-process run of the same config."""

import os
import sys

import numpy as np
import pytest

from fedmpi.results import RunFile

from conftest import ROOT, fedmpi, mpirun, needs_mpi
from helpers import write_config

pytestmark = needs_mpi
PY = [sys.executable, "-m", "fedmpi", "run", "-q"]


@pytest.fixture(scope="module")
def deterministic(tmp_path_factory):
    """The single-process reference of the deterministic config (run once)."""
    tmp = tmp_path_factory.mktemp("det")
    config = write_config(tmp / "det.toml", system={"deterministic": True},
                          data={"augment": True, "crop_padding": 2})
    fedmpi(["run", "-q", str(config), "-o", str(tmp / "single.h5")], check=True)
    return config, tmp / "single.h5"


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
def test_deterministic_is_bitwise_identical_for_any_rank_count(deterministic, tmp_path, n):
    config, single = deterministic
    out = tmp_path / f"n{n}.h5"
    mpirun(n, PY + [str(config), "-o", str(out)])
    with RunFile(single) as a, RunFile(out) as b:
        assert b.status == "completed" and b.attrs["world_size"] == n
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"])
        assert np.array_equal(a.rounds()["test_loss"], b.rounds()["test_loss"])
        assert np.array_equal(a.rounds()["train_loss"], b.rounds()["train_loss"], equal_nan=True)
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["fl_bytes_up"], b.rounds()["fl_bytes_up"])
        ranks = b.clients()["rank"]
        assert set(ranks.tolist()) <= set(range(1, n)) and 0 not in ranks
        assert np.all(b.rounds()["mpi_bytes"] > 0)
        ranks = b.ranks()
        assert len(ranks["rank"]) == 4 * n and sorted(set(ranks["rank"].tolist())) == list(range(n))
        assert b.rounds()["round"].tolist() == [0, 1, 2, 3]   # 0: the initial model, evaluated
        for r, total in zip(b.rounds()["round"], b.rounds()["mpi_bytes"]):
            assert ranks["bytes_sent"][ranks["round"] == r].sum() == total
        workers, trained = ranks["rank"] > 0, ranks["round"] > 0
        assert np.all(ranks["seconds_compute"][workers & trained] > 0) and np.all(ranks["seconds_idle"] >= 0)
        assert np.all(ranks["seconds_compute"][~trained] == 0)


@pytest.mark.slow
def test_fast_mode_agrees_within_tolerance(tmp_path):
    config = write_config(tmp_path / "fast.toml")
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "single.h5")], check=True)
    mpirun(3, PY + [str(config), "-o", str(tmp_path / "n3.h5")])
    with RunFile(tmp_path / "single.h5") as a, RunFile(tmp_path / "n3.h5") as b:
        np.testing.assert_allclose(a.model(), b.model(), rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(a.rounds()["test_acc"], b.rounds()["test_acc"], atol=0.02)


@pytest.mark.slow
def test_toy_protocol_under_mpirun_is_bitwise_single_process(tmp_path):
    config = write_config(tmp_path / "toy.toml", plugins=["toy_algorithms"], rounds=4,
                          algorithm={"name": "toy_probe"}, system={"deterministic": True})
    env = {"PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    mpirun(1, PY + [str(config), "-o", str(tmp_path / "single.h5")], env=env)
    mpirun(3, PY + [str(config), "-o", str(tmp_path / "n3.h5")], env=env)
    with RunFile(tmp_path / "single.h5") as a, RunFile(tmp_path / "n3.h5") as b:
        assert np.array_equal(a.model(), b.model())
        ca, cb = a.clients(), b.clients()
        assert np.array_equal(ca["visits"], cb["visits"], equal_nan=True)
        assert np.array_equal(ca["score"], cb["score"], equal_nan=True)
        assert np.array_equal(a.rounds()["fl_bytes_down"], b.rounds()["fl_bytes_down"])
