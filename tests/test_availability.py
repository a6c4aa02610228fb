"""Who can take part ([system_model] availability, dropout) and device tables from a file:
the availability masks keyed by the seed with the expected fractions, the Markov chain's
stationary share, a trace in closed form; through the runtime: "always" changes nothing,
only available clients are sampled, a resumed Markov run is the uninterrupted one, a
profile table lands in the file exactly, dropout drops the predicted clients; bad inputs
are one-line errors naming the field."""

import math

import h5py
import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.availability import (bernoulli_mask, diurnal_mask, diurnal_phases,
                                         diurnal_probability, dropout_mask, markov_mask,
                                         markov_stationary, trace_mask)
from fedmpi.runtime.vclock import sample_available
from fedmpi.runtime.vclock_inputs import PROFILE_FIELDS, read_profiles, read_trace

from helpers import TINY, merged, run_and_resume

N = 100_000
LOGNORMAL = {"profiles": "lognormal", "step_time": 0.05}
SEED = TINY["seed"]


def within(observed: float, expected: float, std: float) -> bool:
    """Within 5 binomial standard deviations (a false alarm about once in 3.5 million)."""
    return abs(observed - expected) <= 5 * std


# ---- the masks, in closed form -------------------------------------------------------------

@pytest.mark.parametrize("p", [0.2, 0.7])
def test_bernoulli_mask_is_keyed_by_the_seed_and_has_fraction_p(p):
    a = bernoulli_mask(7, 3, N, p)
    assert np.array_equal(a, bernoulli_mask(7, 3, N, p))
    assert not np.array_equal(a, bernoulli_mask(8, 3, N, p))
    assert not np.array_equal(a, bernoulli_mask(7, 4, N, p))
    assert np.array_equal(bernoulli_mask(7, 3, 1000, p), a[:1000])   # client c's draw is its own
    assert within(a.mean(), p, math.sqrt(p * (1 - p) / N))


def test_markov_chain_starts_stationary_stays_so_and_steps_once_a_round():
    on_off, off_on = 0.2, 0.05
    pi = markov_stationary(on_off, off_on)
    assert pi == pytest.approx(0.2)
    states = [markov_mask(7, 0, N, on_off, off_on)]
    for t in range(1, 5):
        states.append(markov_mask(7, t, N, on_off, off_on, states[-1], t - 1))
    for s in states:
        assert within(s.mean(), pi, math.sqrt(pi * (1 - pi) / N))
    for before, after in zip(states, states[1:]):
        on, off = before.sum(), (~before).sum()
        assert within((before & ~after).sum() / on, on_off, math.sqrt(on_off * (1 - on_off) / on))
        assert within((~before & after).sum() / off, off_on, math.sqrt(off_on * (1 - off_on) / off))
    # a pure function of (seed, round): replayed from round 0 (resume) it is the same chain
    assert np.array_equal(markov_mask(7, 4, N, on_off, off_on), states[4])
    assert not np.array_equal(markov_mask(8, 4, N, on_off, off_on), states[4])


def test_diurnal_mask_follows_the_virtual_hour():
    phases = diurnal_phases(7, N)
    assert np.array_equal(phases, diurnal_phases(7, N)) and not np.array_equal(phases, diurnal_phases(8, N))
    assert phases.min() >= 0 and phases.max() < 24
    for t, now in enumerate((0.0, 6 * 3600.0, 13.5 * 3600.0)):
        p = diurnal_probability(phases, now, 0.4, 0.5)
        np.testing.assert_allclose(p, np.clip(0.4 + 0.5 * np.sin(2 * np.pi * (now / 3600 + phases) / 24), 0, 1))
        mask = diurnal_mask(7, t, phases, now, 0.4, 0.5)
        assert within(mask.mean(), p.mean(), math.sqrt(np.sum(p * (1 - p))) / N)
        assert not mask[p == 0].any() and mask[p == 1].all()
    # one client's probability over the day: a sine of period 24 h around the base
    one = np.array([3.0])
    day = [diurnal_probability(one, h * 3600.0, 0.5, 0.25)[0] for h in (0, 3, 9, 15, 21, 24)]
    np.testing.assert_allclose(day, [0.5 + 0.25 * math.sin(math.pi / 4), 0.75, 0.5, 0.25, 0.5,
                                     0.5 + 0.25 * math.sin(math.pi / 4)], atol=1e-12)


TRACE = """client,start,end
0,0,1e-6
1,0,1e-6
5,0,1e-6
5,1e7,1e8
2,1000,inf
3,1000,2000
4,1000.5,5000
11,3000,1e9
"""


def test_a_trace_makes_available_exactly_the_covering_intervals(tmp_path):
    (tmp_path / "t.csv").write_text(TRACE)
    trace = read_trace(str(tmp_path / "t.csv"), 12)
    covering = {0.0: [0, 1, 5], 1e-6: [], 999.0: [], 1000.0: [2, 3], 1500.0: [2, 3, 4],
                2000.0: [2, 4], 3000.0: [2, 4, 11], 1e7: [2, 5, 11], 2e9: [2]}
    for now, expected in covering.items():
        assert np.flatnonzero(trace_mask(trace, 12, now)).tolist() == expected, now


def test_sampling_among_the_available_maps_back_to_their_slots():
    pool = np.array([1, 4, 6, 9, 11])
    picked = sample_available(3, 2, pool, 3)
    assert len(picked) == 3 and set(picked) <= set(pool) and np.all(np.diff(picked) > 0)
    assert sample_available(3, 2, pool, 8).tolist() == pool.tolist()   # fewer: all of them
    assert len(sample_available(3, 2, np.zeros(0, int), 3)) == 0
    sizes = np.array([5, 5, 5, 5, 0, 5, 0, 5, 5, 5, 5, 5])
    assert sample_available(3, 2, np.array([1, 4, 6]), 2, "size", sizes).tolist() == [1]
    picked = sample_available(3, 2, pool, 2, "bernoulli")   # q = 2 / 5 among the five
    assert set(picked) <= set(pool)
    assert sample_available(3, 2, pool, 5, "bernoulli").tolist() == pool.tolist()   # q = 1


# ---- through the runtime -------------------------------------------------------------------

def run(tmp_path, name, **over):
    values = merged(TINY, **{"system": {"threads": 1}, **over})
    values["output"] = str(tmp_path / f"{name}.h5")
    run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    return RunFile(tmp_path / f"{name}.h5")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """TINY with lognormal profiles, everyone always available: rounds and clients."""
    with run(tmp_path_factory.mktemp("ref"), "ref", system_model=LOGNORMAL) as r:
        return {"rounds": r.rounds(), "clients": r.clients(), "model": r.model()}


def test_always_and_everyone_available_train_todays_bits(tmp_path, reference):
    with run(tmp_path, "off") as off, \
            run(tmp_path, "all", system_model={**LOGNORMAL, "availability": "bernoulli",
                                               "availability_p": 1.0}) as everyone:
        assert np.array_equal(off.model(), reference["model"])
        assert np.array_equal(everyone.model(), reference["model"])
        assert np.array_equal(everyone.clients()["client"], reference["clients"]["client"])
        for rounds in (reference["rounds"], everyone.rounds()):
            assert math.isnan(rounds["n_available"][0])
            assert rounds["n_available"][1:].tolist() == [12, 12, 12]
        assert "n_available" not in off.rounds()


@pytest.mark.parametrize("kind", ["bernoulli", "diurnal"])
def test_sampled_clients_are_always_available(tmp_path, kind):
    """The file's clients, against the mask recomputed from the seed (diurnal: at the
    round's start, the previous round's virtual_time)."""
    with run(tmp_path, kind, rounds=4, system_model={
            **LOGNORMAL, "availability": kind, "availability_p": 0.3,
            "diurnal_base": 0.3, "diurnal_amplitude": 0.3}) as r:
        rounds, clients = r.rounds(), r.clients()
        for t in range(1, 5):
            mask = bernoulli_mask(SEED, t - 1, 12, 0.3) if kind == "bernoulli" else \
                diurnal_mask(SEED, t - 1, diurnal_phases(SEED, 12), rounds["virtual_time"][t - 1],
                             0.3, 0.3)
            mine = clients["client"][clients["round"] == t].astype(int)
            assert mask[mine].all()
            assert rounds["n_available"][t] == mask.sum()
            assert len(mine) == min(5, mask.sum())   # fewer available than needed: all of them
        assert rounds["n_available"][1:].min() < 12


def test_a_trace_samples_exactly_the_clients_covering_the_round_start(tmp_path):
    """clients.per_round = num: every available client is taken, so a round's clients are
    its pool. Round 1 starts at 0; round 2 finds nobody and waits for 1000 s; round 3
    starts a few seconds later (a round takes seconds here)."""
    (tmp_path / "t.csv").write_text(TRACE)
    with run(tmp_path, "trace", clients={"per_round": 12},
             system_model={**LOGNORMAL, "availability": "trace",
                           "availability_file": str(tmp_path / "t.csv")}) as r:
        rounds, clients = r.rounds(), r.clients()
        trace = read_trace(str(tmp_path / "t.csv"), 12)
        starts = [clients["vt_start"][clients["round"] == t][0] for t in (1, 2, 3)]
        assert starts[0] == 0.0 and starts[1] == 1000.0 and 1000.5 < starts[2] < 2000
        assert starts[2] == rounds["virtual_time"][2]
        expected = [[0, 1, 5], [2, 3], [2, 3, 4]]
        for t, start, want in zip((1, 2, 3), starts, expected):
            assert np.flatnonzero(trace_mask(trace, 12, start)).tolist() == want
            assert clients["client"][clients["round"] == t].astype(int).tolist() == want
            assert rounds["n_available"][t] == len(want)


def test_resume_with_markov_gives_the_uninterrupted_file(tmp_path):
    values = merged(TINY, rounds=4, clients={"per_round": 4},
                    system={"deterministic": True, "checkpoint_every": 2, "threads": 1},
                    system_model={**LOGNORMAL, "availability": "markov", "p_on_off": 0.5,
                                  "p_off_on": 0.5, "dropout": 0.2})
    crashed, exp = run_and_resume(values, tmp_path)   # died after round 4 was flushed: resume from 2
    assert exp.start == 2
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        for name in ("virtual_time", "n_available", "n_dropped", "n_participants", "test_acc"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True), name
        for name in ("client", "round", "vt_end", "dropped"):
            assert np.array_equal(a.clients()[name], b.clients()[name], equal_nan=True), name
        assert np.array_equal(a.model(), b.model())
        clients = a.clients()
        for t in range(1, 5):   # and the chain is the closed-form one
            mask = markov_mask(SEED, t - 1, 12, 0.5, 0.5)
            assert mask[clients["client"][clients["round"] == t].astype(int)].all()
            assert a.rounds()["n_available"][t] == mask.sum()


def profile_table(n: int) -> dict:
    rng = np.random.default_rng(0)
    return {"client": rng.permutation(n), "speed": rng.uniform(0.1, 3, n),
            "down_mbps": rng.uniform(1, 50, n), "up_mbps": rng.uniform(0.5, 10, n),
            "latency": rng.uniform(0, 0.2, n)}


def write_csv(path, table: dict, rows=None) -> str:
    names = list(table)
    lines = [",".join(names)] + [",".join(repr(float(table[k][i])) if k != "client" else
                                          str(int(table[k][i])) for k in names)
                                 for i in (range(len(table["client"])) if rows is None else rows)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_profile_file_lands_in_the_file_exactly(tmp_path):
    table = profile_table(12)
    path = write_csv(tmp_path / "p.csv", table)
    np.savez(tmp_path / "p.npz", **table)
    order = np.argsort(table["client"])
    for loaded in (read_profiles(path, 12), read_profiles(str(tmp_path / "p.npz"), 12)):
        for k in PROFILE_FIELDS:
            assert np.array_equal(loaded[k], table[k][order])
    with run(tmp_path, "file", rounds=1, system_model={"profiles": "file", "profile_file": path}) as r:
        part, clients = r.partition(), r.clients()
        for k in PROFILE_FIELDS:
            assert np.array_equal(part[f"device_{k}"], table[k][order])
        c = clients["client"].astype(int)
        p = {k: table[k][order][c] for k in PROFILE_FIELDS}
        expected = clients["bytes_down"] * 8 / (p["down_mbps"] * 1e6) + p["latency"] \
            + clients["steps"] * 0.05 / p["speed"] + clients["bytes_up"] * 8 / (p["up_mbps"] * 1e6) \
            + p["latency"]
        np.testing.assert_allclose(clients["vt_end"] - clients["vt_start"], expected, rtol=1e-12)


def test_a_dynamic_population_needs_a_profile_for_every_identity(tmp_path):
    """More identities than clients.num: the table is checked when the clock is set up."""
    path = write_csv(tmp_path / "p.csv", profile_table(12))
    values = merged(TINY, rounds=4, clients={"replace_prob": 0.5, "replace_every": 1},
                    system_model={"profiles": "file", "profile_file": path})
    values["output"] = str(tmp_path / "never.h5")
    config = cfg.from_dict(values)   # ids 0..11 are fine for all the config knows
    with pytest.raises(UsageError) as err:
        run_experiment(config, LocalComm(), quiet=True)
    assert "system_model.profile_file" in str(err.value) and "no row for client 12" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "never.h5").exists()


def test_dropout_drops_exactly_the_predicted_clients(tmp_path, reference):
    with run(tmp_path, "drop", system_model={**LOGNORMAL, "dropout": 0.4}) as r:
        rounds, clients = r.rounds(), r.clients()
        ref = reference["clients"]
        for t in (1, 2, 3):
            sampled = ref["client"][ref["round"] == t].astype(int)   # the same draws
            gone = dropout_mask(SEED, t - 1, sampled, 12, 0.4)
            mine = clients["round"] == t
            kept = mine & (clients["dropped"] == 0)
            assert clients["client"][kept].astype(int).tolist() == sampled[~gone].tolist()
            assert clients["client"][mine & (clients["dropped"] == 2)].astype(int).tolist() == \
                sampled[gone].tolist()   # named, flagged as dropped out
            assert np.all(np.isnan(clients["vt_end"][mine & (clients["dropped"] == 2)]))
            assert rounds["n_dropped"][t] == gone.sum()
            assert rounds["dropped_bytes_down"][t] == gone.sum() * ref["bytes_down"][0]
        assert rounds["n_dropped"][1:].sum() > 0
        assert np.all(rounds["n_participants"][1:] + rounds["n_dropped"][1:] == 5)


# ---- refused at config time ----------------------------------------------------------------

def write_text(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def device_link(path) -> str:
    """A link to a device: to /dev/zero, a CSV line that never ends (/dev/null here, which
    a regression reads harmlessly and the message still tells)."""
    path.symlink_to("/dev/null")
    return str(path)


def bad_file(tmp_path, kind: str) -> str:
    """A profile table that is wrong in one way."""
    table = profile_table(12)
    if kind == "malformed":
        path = tmp_path / "bad.csv"
        path.write_text("client,speed,down_mbps,up_mbps,latency\n0,1,2,3\n")
        return str(path)
    if kind == "not a number":
        path = tmp_path / "bad.csv"
        path.write_text("client,speed,down_mbps,up_mbps,latency\n0,1,2,3,0\n1,fast,2,3,0\n")
        return str(path)
    if kind == "missing column":
        table.pop("latency")
    if kind == "negative":
        table["up_mbps"][5] = -1.0
    if kind == "duplicate":
        table["client"][3] = table["client"][4]
    rows = range(11) if kind == "missing client" else None
    return write_csv(tmp_path / "bad.csv", table, rows)


@pytest.mark.parametrize("section,message", [
    (lambda d: {"profiles": "file", "profile_file": str(d / "none.csv")},
     "system_model.profile_file: {d}/none.csv does not exist"),
    (lambda d: {"profiles": "file", "profile_file": bad_file(d, "malformed")},
     "system_model.profile_file: {d}/bad.csv line 2 has 4 fields"),
    (lambda d: {"profiles": "file", "profile_file": bad_file(d, "not a number")},
     "system_model.profile_file: {d}/bad.csv line 3: speed 'fast' is not a number"),
    (lambda d: {"profiles": "file", "profile_file": bad_file(d, "missing column")},
     "system_model.profile_file: {d}/bad.csv has no column latency"),
    (lambda d: {"profiles": "file", "profile_file": bad_file(d, "missing client")},
     "system_model.profile_file: {d}/bad.csv has no row for client"),
    (lambda d: {"profiles": "file", "profile_file": bad_file(d, "negative")},
     "up_mbps must be a finite number > 0, got -1.0"),
    (lambda d: {"profiles": "file", "profile_file": bad_file(d, "duplicate")},
     "system_model.profile_file: {d}/bad.csv: client"),
    (lambda d: {"profiles": "file"}, "system_model.profile_file: needs a file path"),
    (lambda d: {"profiles": "file", "profile_file": device_link(d / "dev.csv")},
     "system_model.profile_file: {d}/dev.csv is not a regular file (a device, a pipe or a socket)"),
    (lambda d: {**LOGNORMAL, "profile_file": bad_file(d, "ok")},
     "system_model.profile_file: is read with system_model.profiles = \"file\" only"),
    (lambda d: {**LOGNORMAL, "availability": "trace", "availability_file": str(d / "none.csv")},
     "system_model.availability_file: {d}/none.csv does not exist"),
    (lambda d: {**LOGNORMAL, "availability": "trace",
                "availability_file": write_text(d / "t.csv", "client,start,end\n0,10,5\n")},
     "system_model.availability_file: {d}/t.csv: client 0's interval [10.0, 5.0) needs a finite start"),
    (lambda d: {**LOGNORMAL, "availability": "trace",
                "availability_file": write_text(d / "t.csv", "client,start\n0,10\n")},
     "system_model.availability_file: {d}/t.csv has no column end"),
    (lambda d: {**LOGNORMAL, "availability": "sometimes"},
     "system_model.availability: 'sometimes' is not allowed"),
    (lambda d: {**LOGNORMAL, "availability": "bernoulli", "availability_p": 1.5},
     "system_model.availability_p: must be in (0, 1], got 1.5"),
    (lambda d: {**LOGNORMAL, "availability": "bernoulli", "availability_p": 0.0},
     "system_model.availability_p: must be in (0, 1], got 0.0"),
    (lambda d: {**LOGNORMAL, "availability": "markov", "p_on_off": 0.0},
     "system_model.p_on_off: must be in (0, 1]"),
    (lambda d: {**LOGNORMAL, "availability": "diurnal", "diurnal_base": -0.5},
     "system_model.diurnal_base: must be in [0, 1]"),
    (lambda d: {**LOGNORMAL, "dropout": 1.0}, "system_model.dropout: must be in [0, 1), got 1.0"),
    (lambda d: {"availability": "bernoulli"}, "system_model.availability: runs on the virtual clock"),
    (lambda d: {**LOGNORMAL, "policy": "fedbuff", "availability": "markov"},
     "system_model.availability: system_model.policy 'fedbuff' draws"),
    (lambda d: {**LOGNORMAL, "policy": "fedasync", "dropout": 0.1},
     "system_model.dropout: system_model.policy 'fedasync' has no mid-round dropout"),
], ids=["missing-file", "malformed-csv", "not-a-number", "missing-column", "missing-client",
        "negative-bandwidth", "duplicate-client", "no-path", "device", "file-without-profiles-file",
        "missing-trace", "trace-end-before-start", "trace-missing-column", "unknown-availability", "p-above-1", "p-zero", "markov-p-zero",
        "diurnal-base", "dropout-1", "without-clock", "async-availability", "async-dropout"])
def test_bad_availability_or_profile_file_is_a_one_line_error(tmp_path, section, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, system_model=section(tmp_path)))
    text = str(err.value)
    assert message.format(d=tmp_path) in text and "\n" not in text


def test_a_resume_refuses_a_changed_profile_file(tmp_path):
    """The run's devices are in its file: a resume reading a different table is refused
    (it would time the rest of the run on other devices), the file left as it was."""
    table = profile_table(12)
    path = write_csv(tmp_path / "p.csv", table)
    values = merged(TINY, rounds=3, system={"threads": 1, "checkpoint_every": 1},
                    system_model={"profiles": "file", "profile_file": path})
    crashed, _ = run_and_resume(values, tmp_path)   # unchanged: resumes
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
    before = crashed.read_bytes()
    table["speed"] = table["speed"] * 2
    write_csv(tmp_path / "p.csv", table)
    with pytest.raises(UsageError, match="the virtual clock's inputs differ from the run's"):
        run_experiment(cfg.from_dict({**values, "output": str(crashed)}), LocalComm(),
                       quiet=True, resume=True)
    assert crashed.read_bytes() == before
