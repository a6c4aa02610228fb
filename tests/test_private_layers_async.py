"""Private layers under the asynchronous policies (FedBuff, FedAsync): each model
version's payload is compacted to the shared coordinates, clients keep their private
layers as state, and with no private layers FedPer is FedAvg under the same policy, bit
for bit."""

import numpy as np
import pytest

from fedmpi.results import RunFile

from conftest import needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file

CLOCK = {"profiles": "lognormal", "step_time": 0.05, "concurrency": 6}
SPLIT = merged(TINY, rounds=4, partition={**TINY["partition"], "local_test": 0.25},
               eval={**TINY["eval"], "clients": "all"},
               system={**TINY["system"], "deterministic": True})


@pytest.mark.parametrize("policy", ["fedbuff", "fedasync"])
def test_fedper_without_private_layers_is_fedavg_under_the_policy(tmp_path, policy):
    clock = {**CLOCK, "policy": policy}
    with run_file(tmp_path, "avg", merged(SPLIT, system_model=clock)) as a, \
            run_file(tmp_path, "per", merged(SPLIT, system_model=clock,
                                             algorithm={"name": "fedper", "private": []})) as b:
        assert np.array_equal(a.model(), b.model())


@pytest.mark.parametrize("policy", ["fedbuff", "fedasync"])
def test_fedper_under_the_policy_sends_the_shared_part_and_keeps_the_head(tmp_path, policy):
    values = merged(SPLIT, system_model={**CLOCK, "policy": policy},
                    algorithm={"name": "fedper"})
    with run_file(tmp_path, "per", values) as r:
        shared, d = r.attrs["shared_params"], r.attrs["num_params"]
        c = r.clients()
        rounds = r.rounds()
    assert shared < d
    assert set(c["bytes_up"].tolist()) == {4 * shared}
    assert np.isfinite(rounds["personal_acc_mean"][-1])


def test_a_resumed_fedbuff_fedper_run_is_the_uninterrupted_one(tmp_path):
    values = merged(SPLIT, system_model={**CLOCK, "policy": "fedbuff"},
                    algorithm={"name": "fedper"},
                    system={**SPLIT["system"], "checkpoint_every": 2})
    crashed, exp = run_and_resume(values, tmp_path)
    assert exp.start == 2
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.client_eval()["personal_accuracy"],
                              b.client_eval()["personal_accuracy"])


@pytest.mark.slow
@needs_mpi
def test_fedbuff_fedper_is_the_same_bits_on_3_ranks(tmp_path):
    values = merged(SPLIT, system_model={**CLOCK, "policy": "fedbuff"},
                    algorithm={"name": "fedper"})
    assert_same_on_3_ranks(tmp_path, values, columns=("test_loss",), client_eval=True)
