"""The virtual clock ([system_model]): device profiles, participation times from the exact
FL ledger in closed form, the synchronous round policies (wait for all, deadline,
over-selection), and through the runtime: off changes nothing, the clock's columns, the
dropped clients exactly the predicted ones, resume and any number of ranks."""

import math
import sys

import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.devices import draw_profiles
from fedmpi.runtime.vclock import durations, schedule, selection_size

from conftest import fedmpi, mpirun, needs_mpi
from helpers import TINY, merged, run_and_resume, write_config

D = 1000   # a FedAvg model of d floats: d * 4 bytes each way


def profiles(speed, down, up, latency):
    return {"speed": np.array(speed, float), "down_mbps": np.array(down, float),
            "up_mbps": np.array(up, float), "latency": np.array(latency, float)}


def test_three_clients_in_closed_form():
    """download = 4d * 8 / (down 1e6) + latency; compute = steps * step_time / speed;
    upload = 4d * 8 / (up 1e6) + latency."""
    p = profiles([1.0, 2.0, 0.5], [8.0, 4.0, 32.0], [1.0, 2.0, 4.0], [0.1, 0.1, 0.1])
    times = durations(np.array([0, 1, 2]), np.array([10, 10, 4]), 4 * D, 4 * D, p, 0.5)
    bits = 4 * D * 8
    expected = [bits / 8e6 + 0.1 + 10 * 0.5 / 1.0 + bits / 1e6 + 0.1,
                bits / 4e6 + 0.1 + 10 * 0.5 / 2.0 + bits / 2e6 + 0.1,
                bits / 32e6 + 0.1 + 4 * 0.5 / 0.5 + bits / 4e6 + 0.1]
    np.testing.assert_allclose(times, expected, rtol=1e-12)
    # by hand: 0.004 + 0.1 + 5 + 0.032 + 0.1; 0.008 + 0.1 + 2.5 + 0.016 + 0.1;
    # 0.001 + 0.1 + 4 + 0.008 + 0.1
    np.testing.assert_allclose(times, [5.236, 2.724, 4.209], rtol=1e-12)


def test_policies_keep_exactly_the_predicted_clients():
    clients, times = np.array([3, 5, 7, 9]), np.array([4.0, 1.0, 2.5, 1.0])
    keep, length = schedule(clients, times, "wait_all", 4, 0.0)
    assert keep.all() and length == 4.0
    keep, length = schedule(clients, times, "deadline", 4, 2.5)
    assert keep.tolist() == [False, True, True, True] and length == 2.5
    keep, length = schedule(clients, times, "deadline", 4, 10.0)
    assert keep.all() and length == 4.0      # everyone in time: the round ends with the last
    keep, length = schedule(clients, times, "overselect", 2, 0.0)
    assert keep.tolist() == [False, True, False, True] and length == 1.0   # tie: by id
    keep, length = schedule(clients, times, "overselect", 3, 0.0)
    assert keep.tolist() == [False, True, True, True] and length == 2.5
    keep, length = schedule(np.zeros(0, int), np.zeros(0), "deadline", 3, 1.0)
    assert len(keep) == 0 and length == 0.0
    assert selection_size("overselect", 10, 0.3, 100) == 13
    assert selection_size("overselect", 10, 0.3, 12) == 12
    assert selection_size("overselect", 3, 1 / 3, 100) == 4   # no float rounding up to 5
    assert selection_size("deadline", 10, 0.3, 100) == 10


def test_profiles_are_keyed_by_the_seed_and_lognormal_around_the_medians():
    model = cfg.from_dict({"system_model": {"profiles": "lognormal", "speed_sigma": 1.0}}).system_model
    a, b = draw_profiles(0, 20000, model), draw_profiles(0, 20000, model)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["speed"], draw_profiles(1, 20000, model)["speed"])
    assert abs(np.median(a["speed"]) - 1.0) < 0.03
    assert abs(np.std(np.log(a["speed"])) - 1.0) < 0.02
    assert abs(np.median(a["down_mbps"]) / model.down_mbps - 1) < 0.03
    assert np.all(a["latency"] == model.latency)


# ---- through the runtime ------------------------------------------------------------------

def run(tmp_path, name, **over):
    values = merged(TINY, **over)
    values["output"] = str(tmp_path / f"{name}.h5")
    run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    return RunFile(tmp_path / f"{name}.h5")


LOGNORMAL = {"profiles": "lognormal", "step_time": 0.05}


def test_off_and_wait_for_all_train_the_same_bits(tmp_path):
    """The clock only times the round: with every client kept, the model is today's."""
    with run(tmp_path, "off", system={"threads": 1}) as off, \
            run(tmp_path, "on", system={"threads": 1}, system_model=LOGNORMAL) as on:
        assert np.array_equal(off.model(), on.model())
        assert "virtual_time" not in off.rounds() and "vt_end" not in off.clients()
        rounds, clients, part = on.rounds(), on.clients(), on.partition()
        assert rounds["virtual_time"][0] == 0 and np.all(np.diff(rounds["virtual_time"]) > 0)
        # each round lasts as long as its slowest client, computed from the file alone
        speed, down, up, lat = (part[f"device_{k}"] for k in ("speed", "down_mbps", "up_mbps", "latency"))
        bytes_ = clients["bytes_down"][0]
        c = clients["client"].astype(int)
        expected = bytes_ * 8 / (down[c] * 1e6) + lat[c] + clients["steps"] * 0.05 / speed[c] \
            + clients["bytes_up"] * 8 / (up[c] * 1e6) + lat[c]
        np.testing.assert_allclose(clients["vt_end"] - clients["vt_start"], expected, rtol=1e-12)
        for t in (1, 2, 3):
            mine = clients["round"] == t
            assert rounds["virtual_time"][t] == pytest.approx(clients["vt_end"][mine].max())
            assert np.all(clients["vt_start"][mine] == rounds["virtual_time"][t - 1])


def test_a_deadline_drops_exactly_the_late_clients_and_they_do_not_train(tmp_path):
    over = dict(system={"threads": 1}, clients={"num": 12, "per_round": 6},
                system_model={**LOGNORMAL, "policy": "wait_all"})
    with run(tmp_path, "all", **over) as everyone:
        ends = everyone.clients()["vt_end"] - everyone.clients()["vt_start"]
        deadline = float(np.median(ends))
    over["system_model"] = {**LOGNORMAL, "policy": "deadline", "deadline": deadline}
    with run(tmp_path, "deadline", **over) as late, run(tmp_path, "all2", **{
            **over, "system_model": {**LOGNORMAL}}) as all_:
        a, every = all_.clients(), late.clients()
        kept = every["dropped"] == 0
        b = {k: v[kept] for k, v in every.items()}
        on_time = (a["vt_end"] - a["vt_start"]) <= deadline
        # the draws are the same (keyed by seed and round): exactly the late ones are gone
        assert b["client"].tolist() == a["client"][on_time].tolist()
        assert b["round"].tolist() == a["round"][on_time].tolist()
        rounds = late.rounds()
        assert np.all(rounds["n_participants"][1:] + rounds["n_dropped"][1:] == 6)
        assert rounds["n_dropped"][1:].sum() > 0
        assert np.all(rounds["dropped_bytes_down"][1:] == rounds["n_dropped"][1:] * b["bytes_down"][0])
        assert np.all(np.diff(rounds["virtual_time"]) <= deadline + 1e-12)
        assert np.all(b["vt_end"] - b["vt_start"] <= deadline)
        # the late ones are named: their rows follow each round's kept ones, flagged late,
        # with what they downloaded, nothing uploaded, and when they would have finished
        gone = {k: v[~kept] for k, v in every.items()}
        order = np.lexsort((a["client"], a["round"]))
        assert sorted(zip(gone["round"], gone["client"])) == \
            sorted(zip(a["round"][order][~on_time[order]], a["client"][order][~on_time[order]]))
        assert np.all(gone["dropped"] == 1) and np.all(gone["bytes_up"] == 0)
        assert np.all(gone["bytes_down"] == b["bytes_down"][0]) and np.all(np.isnan(gone["train_loss"]))
        assert np.all(gone["vt_end"] - gone["vt_start"] > deadline)
        for t in range(1, 4):
            assert (every["round"] == t).sum() == 6 and rounds["fl_bytes_down"][t] == \
                b["bytes_down"][b["round"] == t].sum()


def test_overselection_keeps_the_first_per_round_to_finish(tmp_path):
    with run(tmp_path, "over", system={"threads": 1}, clients={"num": 12, "per_round": 4},
             system_model={**LOGNORMAL, "policy": "overselect", "overselect": 0.5}) as r:
        rounds = r.rounds()
        assert rounds["n_participants"][1:].tolist() == [4, 4, 4]
        assert rounds["n_dropped"][1:].tolist() == [2, 2, 2]   # ceil(4 * 1.5) - 4
        clients = r.clients()
        for t in (1, 2, 3):
            mine, late = (clients["round"] == t) & (clients["dropped"] == 0), \
                (clients["round"] == t) & (clients["dropped"] == 1)
            assert mine.sum() == 4 and late.sum() == 2
            assert rounds["virtual_time"][t] - rounds["virtual_time"][t - 1] == \
                pytest.approx((clients["vt_end"][mine] - clients["vt_start"][mine]).max())
            assert clients["vt_end"][late].min() >= clients["vt_end"][mine].max()   # slower


def test_resume_continues_the_virtual_time(tmp_path):
    values = merged(TINY, rounds=5, system={"deterministic": True, "checkpoint_every": 2},
                    system_model={**LOGNORMAL, "policy": "overselect"})
    crashed, exp = run_and_resume(values, tmp_path)   # died after round 5 was flushed: resume from 4
    assert exp.start == 4
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        for name in ("virtual_time", "n_dropped", "test_acc"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)
        assert np.array_equal(a.clients()["vt_end"], b.clients()["vt_end"])
        assert np.array_equal(a.model(), b.model())


@pytest.mark.slow
@needs_mpi
def test_deadline_run_is_bitwise_the_same_for_1_2_and_3_ranks(tmp_path):
    over = dict(rounds=2, system={"deterministic": True},
                system_model={**LOGNORMAL, "policy": "deadline", "deadline": 0.3})
    config = write_config(tmp_path / "d.toml", **over)
    for n in (2, 3):
        mpirun(n, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                   str(tmp_path / f"n{n}.h5")])
    with run(tmp_path, "one", **over) as a:
        assert a.rounds()["n_dropped"][1:].sum() > 0
        for n in (2, 3):
            with RunFile(tmp_path / f"n{n}.h5") as b:
                for name in ("virtual_time", "n_dropped", "n_participants", "test_acc"):
                    assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)
                for name in ("client", "dropped"):
                    assert np.array_equal(a.clients()[name], b.clients()[name])
                assert np.array_equal(a.clients()["vt_end"], b.clients()["vt_end"], equal_nan=True)
                assert np.array_equal(a.model(), b.model())


# ---- refused at config time ---------------------------------------------------------------

@pytest.mark.parametrize("section,message", [
    ({"profiles": "lognormal", "down_mbps": -1.0}, "system_model.down_mbps: must be > 0"),
    ({"profiles": "lognormal", "step_time": 0.0}, "system_model.step_time: must be > 0"),
    ({"profiles": "lognormal", "latency": -0.1}, "system_model.latency: must be >= 0"),
    ({"profiles": "lognormal", "policy": "deadline"}, "system_model.deadline: policy \"deadline\" needs"),
    ({"profiles": "lognormal", "policy": "deadline", "deadline": -2.0}, "system_model.deadline: must be >= 0"),
    ({"policy": "deadline", "deadline": 5.0}, "system_model.policy: 'deadline' times the clients"),
    ({"profiles": "trace"}, "system_model.profiles: 'trace' is not allowed"),
    ({"profiles": "lognormal", "policy": "async"}, "system_model.policy: 'async' is not allowed"),
    ({"profiles": "lognormal", "speed_sigma": math.inf}, "system_model.speed_sigma: must be a finite"),
    ({"measure_step_time": True}, "system_model.measure_step_time: runs on the virtual clock"),
])
def test_bad_system_model_is_a_one_line_error(section, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, system_model=section))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_what_the_clock_cannot_time_is_refused():
    with pytest.raises(UsageError, match="clients.sampling \"bernoulli\""):
        cfg.from_dict(merged(TINY, clients={"sampling": "bernoulli"},
                             system_model={**LOGNORMAL, "policy": "overselect"}))


def test_refusal_through_the_cli_exits_2(tmp_path):
    config = write_config(tmp_path / "bad.toml", system_model={"profiles": "lognormal",
                                                               "up_mbps": 0.0})
    proc = fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "never.h5")])
    assert proc.returncode == 2 and not (tmp_path / "never.h5").exists()
    assert "system_model.up_mbps" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_measured_step_time_is_stored_and_a_resume_keeps_it(tmp_path):
    """measure_step_time: the first worker times this model's local steps; the file keeps
    the value, the clock runs on it, training is untouched, and a resume takes the file's
    value instead of measuring again (so its virtual times continue the run's)."""
    values = merged(TINY, rounds=4, system={"threads": 1, "checkpoint_every": 2},
                    system_model={**LOGNORMAL, "measure_step_time": True})
    crashed, exp = run_and_resume(values, tmp_path)   # resumed from round 2
    with RunFile(tmp_path / "ref.h5") as r, run(tmp_path, "given", system={"threads": 1},
                                                rounds=4, system_model=LOGNORMAL) as given:
        step = float(r.attrs["step_time"])
        assert r.attrs["step_time_measured"] and 0 < step < 1 and step != 0.05
        assert given.attrs["step_time"] == 0.05 and not given.attrs["step_time_measured"]
        assert np.array_equal(r.model(), given.model())
        clients, part = r.clients(), r.partition()
        c = clients["client"].astype(int)
        compute = clients["steps"] * step / part["device_speed"][c]
        np.testing.assert_allclose(clients["vt_end"] - clients["vt_start"] - compute,
                                   given.clients()["vt_end"] - given.clients()["vt_start"]
                                   - clients["steps"] * 0.05 / part["device_speed"][c], rtol=1e-9)
    assert exp.start == 2 and exp.clock.step_time == step
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert np.array_equal(a.rounds()["virtual_time"], b.rounds()["virtual_time"])


def test_named_tiers_give_each_client_its_tier_by_share():
    model = cfg.from_dict(merged(TINY, system_model={
        "profiles": "tiers", "tier_names": ["low", "high"], "tier_shares": [0.25, 0.75],
        "tier_speeds": [0.2, 2.0], "tier_down_mbps": [1.0, 50.0], "tier_up_mbps": [0.5, 10.0],
        "latency": 0.1})).system_model
    p = draw_profiles(7, 4000, model)
    assert abs((p["tier"] == 0).mean() - 0.25) < 5 * (0.25 * 0.75 / 4000) ** 0.5
    for k, values in (("speed", [0.2, 2.0]), ("down_mbps", [1.0, 50.0]), ("up_mbps", [0.5, 10.0])):
        assert np.array_equal(p[k], np.array(values)[p["tier"]])
    assert np.all(p["latency"] == 0.1)
    assert np.array_equal(p["tier"], draw_profiles(7, 4000, model)["tier"])


def test_tiers_and_per_sample_step_times_through_a_run(tmp_path):
    tiers = {"profiles": "tiers", "tier_shares": [0.5, 0.5], "tier_speeds": [0.5, 4.0],
             "tier_down_mbps": [5.0, 40.0], "tier_up_mbps": [1.0, 8.0],
             "step_unit": "sample", "step_time": 0.002}
    with run(tmp_path, "tiers", system={"threads": 1}, rounds=2, system_model=tiers) as r:
        part, clients = r.partition(), r.clients()
        tier = part["device_tier"]
        assert set(tier.tolist()) == {0, 1}
        assert np.array_equal(part["device_speed"], np.array([0.5, 4.0])[tier])
        c = clients["client"].astype(int)
        expected = clients["bytes_down"] * 8 / (part["device_down_mbps"][c] * 1e6) + 0.1 + \
            clients["n_samples"] * 0.002 / part["device_speed"][c] + \
            clients["bytes_up"] * 8 / (part["device_up_mbps"][c] * 1e6)   # E = 1: samples
        np.testing.assert_allclose(clients["vt_end"] - clients["vt_start"], expected, rtol=1e-12)


@pytest.mark.parametrize("section,message", [
    ({"tier_shares": [0.5, 0.6], "tier_speeds": [1, 2], "tier_down_mbps": [1, 2], "tier_up_mbps": [1, 2]},
     "system_model.tier_shares: must sum to 1, got 1.1"),
    ({"tier_shares": [0.5, 0.5], "tier_speeds": [1], "tier_down_mbps": [1, 2], "tier_up_mbps": [1, 2]},
     "system_model.tier_speeds: has 1 entries, system_model.tier_shares 2"),
    ({"tier_shares": [1.0], "tier_speeds": [-1], "tier_down_mbps": [1], "tier_up_mbps": [1]},
     "system_model.tier_speeds: must be numbers > 0, got -1"),
    ({"tier_shares": [1.0], "tier_speeds": [1], "tier_down_mbps": [1]},
     "system_model.tier_up_mbps: profiles \"tiers\" needs a list"),
    ({"tier_names": ["a", "a"], "tier_shares": [0.5, 0.5], "tier_speeds": [1, 2],
      "tier_down_mbps": [1, 2], "tier_up_mbps": [1, 2]}, "system_model.tier_names: must be distinct"),
])
def test_bad_tiers_are_a_one_line_error(section, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, system_model={"profiles": "tiers", **section}))
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UsageError, match="system_model.tier_speeds: describes device tiers"):
        cfg.from_dict(merged(TINY, system_model={"profiles": "lognormal", "tier_speeds": [1.0]}))
    with pytest.raises(UsageError, match="system_model.step_unit: 'epoch' is not allowed"):
        cfg.from_dict(merged(TINY, system_model={"profiles": "lognormal", "step_unit": "epoch"}))


def test_a_later_phase_is_timed_after_the_first(tmp_path):
    """FNR-FL: the refined clients start when the training phase has ended, and the round
    waits for all of them; the clock only times, so the model is the one without it."""
    over = dict(rounds=2, system={"threads": 1}, algorithm={"name": "fnrfl"},
                data={**TINY["data"], "public_size": 60})
    with run(tmp_path, "off", **over) as off, run(tmp_path, "on", **over, system_model=LOGNORMAL) as on:
        assert np.array_equal(off.model(), on.model())
        rounds, clients, part = on.rounds(), on.clients(), on.partition()
        c = clients["client"].astype(int)
        speed, down, up, lat = (part[f"device_{k}"] for k in ("speed", "down_mbps", "up_mbps", "latency"))
        expected = clients["bytes_down"] * 8 / (down[c] * 1e6) + lat[c] + clients["steps"] * 0.05 / speed[c] \
            + clients["bytes_up"] * 8 / (up[c] * 1e6) + lat[c]
        np.testing.assert_allclose(clients["vt_end"] - clients["vt_start"], expected, rtol=1e-12)
        for t in (1, 2):
            train = (clients["round"] == t) & (clients["phase"] == 0)
            refine = (clients["round"] == t) & (clients["phase"] == 1)
            assert refine.sum() > 0
            assert np.all(clients["vt_start"][refine] == clients["vt_end"][train].max())
            assert rounds["virtual_time"][t] == clients["vt_end"][refine].max()
            assert np.all(clients["vt_start"][train] == rounds["virtual_time"][t - 1])
