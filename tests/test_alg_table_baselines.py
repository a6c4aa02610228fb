"""The seed papers' table baselines (FedDC, FedNTD, FedLC, FedMLB, FedDecorr supervised and
self-supervised, FedX over SimCLR and BYOL, L-DAWA, Orchestra) through the real runtime:
single process, then under real ``mpirun -n 2`` and ``-n 3``, bitwise the same model,
losses and FL bytes, and the FL bytes each method declares (``message_sizes``)."""

import numpy as np
import pytest
from conftest import mpirun_configs, needs_mpi
from helpers import SSL, TINY, merged

from fedmpi import config as cfg
from fedmpi.algorithms import REGISTRY, message_sizes
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

HEADS = {"proj_dim": 16, "proj_hidden": 32, "pred_hidden": 16}
SUPERVISED = merged(TINY, rounds=2, clients={"num": 6, "per_round": 4}, system={"deterministic": True})
SELF_SUPERVISED = merged(SSL, rounds=2)


def _orchestra():
    values = merged(SELF_SUPERVISED, algorithm={"name": "orchestra", "proj_dim": 16, "proj_hidden": 32,
                                                "global_clusters": 8, "local_clusters": 4,
                                                "memory_size": 32, "global_iters": 20})
    del values["algorithm"]["pred_hidden"]
    return values


CASES = {
    "feddc": merged(SUPERVISED, algorithm={"name": "feddc"}),
    "fedntd": merged(SUPERVISED, algorithm={"name": "fedntd"}),
    "fedlc": merged(SUPERVISED, algorithm={"name": "fedlc"}),
    "fedmlb": merged(SUPERVISED, algorithm={"name": "fedmlb"}),
    "feddecorr": merged(SUPERVISED, algorithm={"name": "feddecorr"}),
    "feddecorr_ssl": merged(SELF_SUPERVISED, algorithm={"name": "feddecorr_ssl", **HEADS}),
    "feddecorr_ssl_simsiam": merged(SELF_SUPERVISED, algorithm={"name": "feddecorr_ssl",
                                                                 "backbone": "simsiam", **HEADS}),
    "fedx": merged(SELF_SUPERVISED, algorithm={"name": "fedx", **HEADS}),
    "fedx_byol": merged(SELF_SUPERVISED, algorithm={"name": "fedx", "backbone": "byol", **HEADS}),
    "ldawa": merged(SELF_SUPERVISED, algorithm={"name": "ldawa", **HEADS}),
    "ldawa_byol_module": merged(SELF_SUPERVISED, algorithm={"name": "ldawa", "backbone": "byol",
                                                             "granularity": "module",
                                                             "normalise": "cosines", **HEADS}),
    "orchestra": _orchestra(),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """name -> (config, d, results path) of each case run in this process."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    for name, values in CASES.items():
        c = cfg.from_dict(merged(values, output=str(tmp / f"{name}.h5")))
        exp = run_experiment(c, LocalComm(), quiet=True)
        out[name] = (c, exp.d, c.output_path())
    return out


def test_every_new_method_is_registered_with_its_declared_messages():
    assert {"feddc", "fedntd", "fedlc", "fedmlb", "feddecorr", "feddecorr_ssl", "fedx", "ldawa",
            "orchestra"} <= set(REGISTRY)
    assert message_sizes(REGISTRY["feddc"]) == "down 2d, up 2d"    # x and c down; Delta and Delta c up
    for name in ("fedntd", "fedlc", "fedmlb", "feddecorr", "feddecorr_ssl", "fedx", "ldawa"):
        assert message_sizes(REGISTRY[name]) == "down d, up d", name


@pytest.mark.parametrize("name", [n for n in CASES if n != "orchestra"])
def test_fl_bytes_are_the_declared_messages(single, name):
    """Per round, the participants times what ``traffic`` declares, in float32 bytes;
    (FedDC: 2d each way; the rest d)."""
    c, d, path = single[name]
    alg = REGISTRY[c.algorithm.name]()
    down, up = alg.traffic(d, "train")
    with RunFile(path) as run:
        assert run.status == "completed"
        rounds = run.rounds()
        assert rounds["fl_bytes_down"].tolist() == [0] + [c.clients.per_round * down * 4] * 2
        assert rounds["fl_bytes_up"].tolist() == [0] + [c.clients.per_round * up * 4] * 2
        assert np.all(np.isfinite(rounds["train_loss"][1:]))


# Under -n 2 as well as -n 3: the methods with client or server state of their own (one
# launch each; every launch costs each rank's torch import, and the suite's time).
TWO_RANKS = ("feddc", "fedx_byol", "ldawa_byol_module", "orchestra")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case under one real ``mpirun -n 3``; the stateful ones under ``-n 2`` too."""
    return {3: mpirun_configs(3, CASES, tmp_path_factory.mktemp("n3")),
            2: mpirun_configs(2, {n: CASES[n] for n in TWO_RANKS}, tmp_path_factory.mktemp("n2"))}


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", CASES)
def test_mpirun_two_and_three_ranks_are_bitwise_the_single_process_run(single, ranks, name):
    with RunFile(single[name][2]) as a:
        model, rounds = a.model(), a.rounds()
        for n in (2, 3) if name in TWO_RANKS else (3,):
            with RunFile(ranks[n][name]) as b:
                assert b.status == "completed" and b.attrs["world_size"] == n
                assert np.array_equal(model, b.model()), (name, n)
                for column in ("train_loss", "test_acc", "fl_bytes_up", "fl_bytes_down"):
                    assert np.array_equal(rounds[column], b.rounds()[column], equal_nan=True), (name, n, column)


def test_orchestra_gathers_its_centroids_without_writing_them_to_the_file(single):
    """The server receives every client's m x p local centroids (``gather_sizes``), but
    /clients keeps only the runtime's columns (``recorded_gather``)."""
    c, d, path = single["orchestra"]
    alg = REGISTRY["orchestra"](REGISTRY["orchestra"].Params(**{k: v for k, v in c.algorithm.params.items()}))
    assert alg.gather_sizes(d) == {"centroids": 4 * 16} and alg.recorded_gather(d) == {}
    with RunFile(path) as run:
        columns = set(run.clients())
        assert not any(name.startswith("centroids") for name in columns)
        assert {"client", "round", "bytes_up"} <= columns
    fednova = REGISTRY["fednova"]()
    assert fednova.recorded_gather(10) == fednova.gather_sizes(10)   # the default keeps all


@pytest.mark.parametrize("name", ["feddc", "fedx_byol", "orchestra", "ldawa"])
def test_a_crash_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, name):
    """Client state (FedDC's h_i and c_i, FedX-BYOL's targets) and server state (FedDC's c
    and mean drift, Orchestra's centroids and target) come back from the checkpoint: 4
    rounds, checkpoints every 2, died after round 4 was flushed, resumed from round 2."""
    from helpers import run_and_resume

    values = merged(CASES[name], rounds=4, system={"checkpoint_every": 2})
    crashed, exp = run_and_resume(values, tmp_path)
    assert exp.start == 2
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert b.status == "completed"
        assert np.array_equal(a.model(), b.model())
        for column in ("train_loss", "test_acc"):
            assert np.array_equal(a.rounds()[column], b.rounds()[column], equal_nan=True)
