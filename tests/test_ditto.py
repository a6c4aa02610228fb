"""Ditto (fedmpi.algorithms.ditto): its global model is FedAvg's bit for bit, its personal
models are scored by per-client evaluation (a client never sampled: the global model),
lambda = 0 on a first participation is the local model FedAvg trains, 1 and 3 ranks and a
resume give the same bits."""

import numpy as np
import pytest

from fedmpi.results import RunFile

from conftest import needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file

SPLIT = merged(TINY, partition={**TINY["partition"], "local_test": 0.25},
               eval={**TINY["eval"], "clients": "all"})
DITTO = merged(SPLIT, algorithm={"name": "ditto", "lam": 0.5})
DETERMINISTIC = {**TINY["system"], "deterministic": True}


def test_the_global_model_is_fedavg_s_and_the_personal_models_are_scored(tmp_path):
    with run_file(tmp_path, "ditto", DITTO) as ditto, run_file(tmp_path, "fedavg", SPLIT) as fedavg:
        assert np.array_equal(ditto.model(), fedavg.model())
        assert np.array_equal(ditto.rounds()["test_acc"], fedavg.rounds()["test_acc"])
        table, trained = ditto.client_eval(), set(ditto.clients()["client"].tolist())
        assert np.array_equal(table["accuracy"], fedavg.client_eval()["accuracy"])
    last = table["round"] == TINY["rounds"]
    never = [i for i, c in enumerate(table["client"][last]) if int(c) not in trained]
    sampled = [i for i, c in enumerate(table["client"][last]) if int(c) in trained]
    assert never and sampled                  # TINY samples 5 of 12 in each of 3 rounds
    personal, plain = table["personal_accuracy"][last], table["accuracy"][last]
    assert np.array_equal(personal[never], plain[never])    # no state: the global model
    assert not np.array_equal(personal[sampled], plain[sampled])


def test_lambda_0_on_a_first_participation_is_the_local_model_fedavg_trains(tmp_path):
    """One client a round, global lr 1: after round 1, x^1 = x^0 + Delta_c (up to the
    rounding of FedAvg's weighted mean), and with lambda = 0 client c's personal model,
    trained from x^0 over the same batches, is x^0 + Delta_c too (read from the
    checkpoint after round 1: the server's x and the client's state)."""
    values = merged(DITTO, rounds=2, algorithm={"name": "ditto", "lam": 0.0},
                    clients={**TINY["clients"], "per_round": 1},
                    system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "run", values) as r:
        client = int(r.clients()["client"][0])
        ckpt = r.checkpoint()
        assert ckpt.round == 1
        states, x = dict(ckpt.states()), ckpt.server["x"]
    assert list(states) == [client] and states[client]["started"][0] == 1
    assert np.allclose(states[client]["v"], x, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@needs_mpi
def test_ditto_is_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    assert_same_on_3_ranks(tmp_path, merged(DITTO, system=DETERMINISTIC), client_eval=True)


def test_a_resumed_ditto_run_has_the_same_personal_scores(tmp_path):
    crashed, _ = run_and_resume(merged(DITTO, system=DETERMINISTIC, rounds=4), tmp_path)
    with RunFile(tmp_path / "ref.h5") as ref, RunFile(crashed) as resumed:
        assert np.array_equal(ref.model(), resumed.model())
        for name, column in ref.client_eval().items():
            assert np.array_equal(column, resumed.client_eval()[name]), name


@pytest.mark.parametrize("over, message", [
    ({"algorithm": {"name": "ditto", "lam": -1.0}}, "algorithm.lam: must be >= 0, got -1.0"),
    ({"algorithm": {"name": "ditto"}, "system": {**TINY["system"], "client_group": 2},
      "train": {**TINY["train"], "optimizer": "adam"}},
     "system.client_group: train.optimizer 'adam' has no group form"),
])
def test_what_ditto_cannot_take_is_refused(over, message):
    import re

    from fedmpi import config as cfg
    from fedmpi.errors import UsageError
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(TINY, **over))
