"""Asynchronous FL on the virtual clock (FedAsync, FedBuff): the event schedule in closed
form, the reductions to synchronous FedAvg and to sequential SGD, resume with clients in
flight, any number of ranks, and what is refused at config time."""

import sys

import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.asyncfl import AsyncSchedule, staleness_weight

from conftest import mpirun, needs_mpi
from helpers import TINY, merged, run_and_resume, write_config

CLOCK = {"profiles": "lognormal", "step_time": 0.05}
EQUAL = {**CLOCK, "speed_sigma": 0.0, "bandwidth_sigma": 0.0}   # every client the same device


def arrivals(step):
    return [(a.client, a.version, a.start, a.end) for a in step]


def test_schedule_in_closed_form():
    """Three clients of 1, 2 and 4 s, all in flight (C = 3), two arrivals a step (K = 2).
    An arrival waits idle in the buffer; a freed slot takes the next idle client."""
    s = AsyncSchedule(seed=0, durations=np.array([1.0, 2.0, 4.0]), concurrency=3, buffer=2)
    # t=0: all three start on version 0; 0 arrives at 1, 1 at 2: the step, at t=2
    assert arrivals(s.step()) == [(0, 0, 0.0, 1.0), (1, 0, 0.0, 2.0)]
    assert (s.version, s.now) == (1, 2.0)
    # 0 and 1 restart at t=2 on version 1 and arrive at 3 and 4; 2 (version 0) also at 4:
    # ties by client id, so 1 fills the buffer and 2 waits for the next step
    assert arrivals(s.step()) == [(0, 1, 2.0, 3.0), (1, 1, 2.0, 4.0)]
    assert (s.version, s.now) == (2, 4.0)
    step = s.step()
    assert arrivals(step) == [(0, 2, 4.0, 5.0), (2, 0, 0.0, 4.0)]
    assert [s.version - 1 - a.version for a in step] == [0, 2]   # staleness
    assert s.versions_in_flight() == {2, 3}


def test_schedule_never_holds_a_client_twice_and_keeps_c_busy():
    rng = np.random.default_rng(1)
    s = AsyncSchedule(seed=4, durations=rng.lognormal(0, 1, 30), concurrency=8, buffer=3)
    for _ in range(200):
        step = s.step()
        assert len({a.client for a in step}) == 3
        assert len(s.flight) == 8 and s.busy.sum() == 8
        assert all(a.end <= s.now for a in step)


def test_clients_without_samples_never_start(tmp_path):
    """partition.min_size = 0: a client with no training samples has nothing to send, and
    its arrival made FedBuff's step 0/0 (a ZeroDivisionError traceback) and FedAsync's a
    false "training diverged". Such clients are never drawn to start; more clients in
    flight than hold samples is one line."""
    s = AsyncSchedule(seed=0, durations=np.ones(6), concurrency=2, buffer=1,
                      able=np.array([False, True, False, True, True, False]))
    assert {a.client for _ in range(30) for a in s.step()} == {1, 3, 4}
    over = dict(data={"num_train": 40}, partition={"min_size": 0}, rounds=4,
                clients={"num": 40, "per_round": 3})
    for policy in ("fedbuff", "fedasync"):
        exp, file = run(tmp_path, policy, **over, system_model={**CLOCK, "policy": policy})
        with file as r:
            assert r.status == "completed"
            sizes, clients = r.partition()["client_sizes"], r.clients()["client"]
        assert (sizes == 0).sum() >= 15 and len(clients) and sizes[clients].min() > 0
    with pytest.raises(UsageError, match=r"^config field system_model.concurrency: 30 clients in "
                       r"flight, but only \d+ of the 40 clients hold training samples"):
        run(tmp_path, "c", **over, system_model={**CLOCK, "policy": "fedbuff", "concurrency": 30})


def test_staleness_weights():
    assert staleness_weight("constant", 7, 0.5) == 1.0
    assert staleness_weight("polynomial", 0, 0.5) == 1.0
    assert staleness_weight("polynomial", 3, 0.5) == pytest.approx(0.5)   # FedBuff 1/sqrt(1+3)


# ---- through the runtime ------------------------------------------------------------------

def run(tmp_path, name, base=TINY, **over):
    values = merged(base, **over)
    values["output"] = str(tmp_path / f"{name}.h5")
    return run_experiment(cfg.from_dict(values), LocalComm(), quiet=True), \
        RunFile(tmp_path / f"{name}.h5")


IID = {**TINY, "partition": {"kind": "iid"}}   # 12 clients of 50 samples: equal step counts


def test_fedbuff_with_k_equal_c_equal_s_and_equal_devices_is_synchronous_fedavg(tmp_path):
    """Equal devices and equal clients: the S in flight arrive together, fill the buffer,
    and the next S start on the new model, drawn as round t draws S_t: FedAvg, bit for bit."""
    over = dict(rounds=4, system={"threads": 1})
    _, sync = run(tmp_path, "sync", IID, **over)
    _, buff = run(tmp_path, "buff", IID, **over, system_model={**EQUAL, "policy": "fedbuff"})
    with sync as a, buff as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"], equal_nan=True)
        assert a.clients()["client"].tolist() == b.clients()["client"].tolist()
        assert np.all(b.clients()["staleness"] == 0)
        rounds = b.rounds()
        assert np.all(np.diff(rounds["virtual_time"]) == pytest.approx(rounds["virtual_time"][1]))


def test_fedasync_with_mixing_1_and_one_in_flight_is_sequential_sgd(tmp_path):
    """C = 1, alpha = 1: each client starts from the model the last one ended at. That is
    FedAvg with one client a round and server lr 1 (to float rounding: x + (n D) / n)."""
    over = dict(rounds=6, system={"threads": 1}, clients={"num": 12, "per_round": 1},
                train={**TINY["train"], "global_lr": 1.0})
    _, seq = run(tmp_path, "seq", **over)
    _, fa = run(tmp_path, "fa", **over, system_model={**CLOCK, "policy": "fedasync", "mixing": 1.0})
    with seq as a, fa as b:
        assert a.clients()["client"].tolist() == b.clients()["client"].tolist()
        np.testing.assert_allclose(a.model(), b.model(), rtol=0, atol=1e-6)
        assert np.all(b.clients()["staleness"] == 0)
        assert not np.array_equal(a.model(), run(tmp_path, "half", **over, system_model={
            **CLOCK, "policy": "fedasync", "mixing": 0.5})[1].model())


def test_fedbuff_rows_and_staleness(tmp_path):
    _, r = run(tmp_path, "fb", rounds=6, system={"threads": 1},
               system_model={**CLOCK, "policy": "fedbuff", "concurrency": 6, "buffer": 2})
    with r:
        rounds, clients = r.rounds(), r.clients()
        assert rounds["n_participants"][1:].tolist() == [2] * 6
        assert clients["staleness"].max() > 0           # heavy-tailed devices: some are stale
        for t in range(1, 7):
            mine = clients["round"] == t
            assert rounds["virtual_time"][t] == clients["vt_end"][mine].max()
            assert np.all(clients["vt_start"][mine] < clients["vt_end"][mine])
        assert np.all(np.diff(rounds["virtual_time"]) >= 0)
        assert np.all(clients["bytes_down"] == clients["bytes_up"])


def test_resume_with_clients_in_flight_is_bitwise_the_uninterrupted_run(tmp_path):
    values = merged(TINY, rounds=6, system={"deterministic": True, "checkpoint_every": 2},
                    system_model={**CLOCK, "policy": "fedbuff", "concurrency": 5, "buffer": 2})
    crashed, exp = run_and_resume(values, tmp_path)   # died after round 5 was flushed: resume from 4
    assert exp.start == 4
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert a.clients()["staleness"].max() > 0   # the checkpoint held stale versions
        for name in ("virtual_time", "test_acc"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)
        for name in ("client", "vt_end", "staleness", "update_norm"):
            assert np.array_equal(a.clients()[name], b.clients()[name])
        assert np.array_equal(a.model(), b.model())


@pytest.mark.slow
@needs_mpi
def test_fedbuff_is_bitwise_the_same_for_1_2_and_3_ranks(tmp_path):
    over = dict(rounds=3, system={"deterministic": True},
                system_model={**CLOCK, "policy": "fedbuff", "concurrency": 5, "buffer": 3})
    config = write_config(tmp_path / "b.toml", **over)
    for n in (2, 3):
        mpirun(n, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                   str(tmp_path / f"n{n}.h5")])
    with run(tmp_path, "one", **over)[1] as a:
        for n in (2, 3):
            with RunFile(tmp_path / f"n{n}.h5") as b:
                assert a.clients()["staleness"].max() > 0
                for name in ("virtual_time", "test_acc"):
                    assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)
                assert np.array_equal(a.clients()["vt_end"], b.clients()["vt_end"])
                assert np.array_equal(a.model(), b.model())


# ---- refused at config time ---------------------------------------------------------------

@pytest.mark.parametrize("section,over,message", [
    ({"policy": "fedbuff", "buffer": 6}, {}, "system_model.buffer: must be <= system_model.concurrency"),
    ({"policy": "fedbuff", "concurrency": 13}, {}, "system_model.concurrency: 13 clients in flight"),
    ({"policy": "fedasync", "mixing": 0.0}, {}, "system_model.mixing: must be in (0, 1]"),
    ({"policy": "fedasync", "mixing": 1.5}, {}, "system_model.mixing: must be in (0, 1]"),
    ({"policy": "fedasync", "staleness": "hinge"}, {}, "system_model.staleness: 'hinge' is not allowed"),
    ({"policy": "fedbuff", "staleness_exponent": -1.0}, {}, "system_model.staleness_exponent: must be >= 0"),
    ({"policy": "fedbuff"}, {"algorithm": {"name": "scaffold"}},
     "system_model.policy: asynchronous FL serves methods with FedAvg's server side; 'scaffold'"),
    ({"policy": "fedbuff"}, {"clients": {"num": 12, "per_round": 5, "sampling": "bernoulli"}},
     "clients.sampling: system_model.policy 'fedbuff' draws"),
    ({"policy": "fedasync"}, {"system": {"client_group": 4}},
     "system.client_group: system_model.policy 'fedasync' trains each client"),
])
def test_bad_async_config_is_a_one_line_error(section, over, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, **over, system_model={**CLOCK, **section}))
    assert message in str(err.value) and "\n" not in str(err.value)

