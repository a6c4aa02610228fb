"""Hostile inputs of the virtual clock: client ids beyond the population or not exact in a
profile table or an availability trace, values whose clock would overflow, a profile table
rewritten in another order before a resume, a column given twice. Each is refused with
one line naming the file (or field), before any results file exists; `fedmpi report` of
a file whose clock did overflow says so instead of printing 0."""

import math
import zipfile

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from fedmpi import config as cfg
from fedmpi.analysis.cli import commands
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.vclock_inputs import read_profiles, read_trace

from conftest import fedmpi
from helpers import TINY, merged, write_config

HEADER = "client,speed,down_mbps,up_mbps,latency"
LOGNORMAL = {"profiles": "lognormal", "step_time": 0.05}


def profile_rows(n: int = 12) -> list[str]:
    return [f"{c},{1.0 + c / 8},{20 + c},{5 + c / 2},0.05" for c in range(n)]


def write(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def profiles_npz(path, client: np.ndarray) -> str:
    n = len(client)
    np.savez(path, client=client, speed=np.ones(n), down_mbps=np.full(n, 20.0),
             up_mbps=np.full(n, 5.0), latency=np.full(n, 0.05))
    return str(path)


def trace_file(d, *rows: str) -> dict:
    return {**LOGNORMAL, "availability": "trace",
            "availability_file": write(d / "t.csv", ["client,start,end", *rows])}


def refusal(section: dict, **over) -> str:
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, system_model=section, **over))
    text = str(err.value)
    assert "\n" not in text
    return text


# ---- client ids: positions 0..N-1, read exactly ----------------------------------------

@pytest.mark.parametrize("make,message", [
    (lambda d: {"profiles": "file", "profile_file": write(d / "p.csv", [HEADER, *profile_rows(11),
                                                                        "1e30,1.0,20,5,0.05"])},
     "system_model.profile_file: {d}/p.csv line 13: client 1e30 is not in the population of 12 "
     "(ids 0..11)"),
    (lambda d: {"profiles": "file", "profile_file": profiles_npz(
        d / "p.npz", np.array(list(range(11)) + [2 ** 64 - 1], dtype=np.uint64))},
     "system_model.profile_file: {d}/p.npz row 12: client 18446744073709551615 is not in the "
     "population of 12 (ids 0..11)"),
    (lambda d: trace_file(d, "0,0,10", "1e29,0,10"),
     "system_model.availability_file: {d}/t.csv line 3: client 1e29 is not in the population "
     "of 12 (ids 0..11)"),
    (lambda d: trace_file(d, "0,0,10", "", "9007199254740993,0,10"),   # a blank line counts
     "system_model.availability_file: {d}/t.csv line 4: client 9007199254740993 is not in the "
     "population of 12 (ids 0..11)"),
    (lambda d: trace_file(d, "1.5,0,10"),
     "system_model.availability_file: {d}/t.csv line 2: client 1.5 is not a client id (a whole "
     "number in 0..11)"),
    (lambda d: trace_file(d, "-1,0,10"),
     "system_model.availability_file: {d}/t.csv line 2: client -1 is not a client id"),
    (lambda d: trace_file(d, "nan,0,10"),
     "system_model.availability_file: {d}/t.csv line 2: client nan is not a client id"),
], ids=["profile-1e30", "profile-npz-uint64-max", "trace-1e29", "trace-2^53+1", "trace-1.5",
        "trace-negative", "trace-nan"])
def test_a_client_id_outside_the_population_names_the_file_the_row_and_the_range(tmp_path, make,
                                                                                 message):
    assert message.format(d=tmp_path) in refusal(make(tmp_path))


def test_a_dynamic_population_refuses_ids_no_population_has_at_config_time(tmp_path):
    """Its number of identities is known at set-up; an id of 2^63 or more is none of them."""
    text = refusal(trace_file(tmp_path, "0,0,10", "1e29,0,10"),
                   clients={"num": 12, "per_round": 5, "replace_prob": 0.5, "replace_every": 1})
    assert f"{tmp_path}/t.csv line 3: client 1e29 is not a client id (a whole number in " \
           f"0..9223372036854775807)" in text


def test_ids_are_read_exactly(tmp_path):
    """No float round trip: 2^53 + 1 stays itself; 7.0 and 7 are the same client."""
    path = write(tmp_path / "t.csv", ["client,start,end", "9007199254740993,0,10", "7.0,1,2",
                                      "+3,0,1"])
    client, start, end = read_trace(path)
    assert client.dtype == np.int64 and client.tolist() == [9007199254740993, 7, 3]
    rows = [HEADER] + [r.replace(f"{c},", f"{c}.0,", 1) if c == 4 else r
                       for c, r in enumerate(profile_rows())]
    assert read_profiles(write(tmp_path / "p.csv", rows), 12)["speed"][4] == 1.5


def test_a_bad_trace_id_through_the_cli_exits_2_and_leaves_no_file(tmp_path):
    config = write_config(tmp_path / "bad.toml", system_model=trace_file(tmp_path, "0,0,10",
                                                                         "1e29,0,10"))
    proc = fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "never.h5")])
    assert proc.returncode == 2 and not (tmp_path / "never.h5").exists(), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "line 3: client 1e29" in proc.stderr


# ---- a clock that would overflow ------------------------------------------------------------

@pytest.mark.parametrize("make,message", [
    (lambda d: {**LOGNORMAL, "step_time": 1e308}, "system_model.step_time: 1e+308 makes"),
    (lambda d: {**LOGNORMAL, "latency": 1e308}, "system_model.latency: 1e+308 makes"),
    (lambda d: {**LOGNORMAL, "down_mbps": 5e-324}, "system_model.down_mbps: 5e-324 makes"),
    (lambda d: {**LOGNORMAL, "up_mbps": 5e-324}, "system_model.up_mbps: 5e-324 makes"),
    (lambda d: {"profiles": "file", "profile_file": write(
        d / "p.csv", [HEADER, *profile_rows(4), "4,5e-324,20,5,0.05", *profile_rows(12)[5:]])},
     "system_model.profile_file: {d}/p.csv: client 4's speed 5e-324 makes"),
    (lambda d: {"profiles": "tiers", "tier_shares": [0.5, 0.5], "tier_speeds": [1.0, 5e-324],
                "tier_down_mbps": [20.0, 20.0], "tier_up_mbps": [5.0, 5.0]},
     "system_model.tier_speeds: 5e-324 makes"),
], ids=["step_time", "latency", "down_mbps", "up_mbps", "file-speed", "tier-speed"])
def test_values_that_overflow_the_clock_are_refused_at_config_time(tmp_path, make, message):
    text = refusal(make(tmp_path))
    assert message.format(d=tmp_path) in text and "virtual clock overflow" in text


def test_an_overflow_only_the_real_byte_counts_show_is_refused_before_the_results_file(tmp_path):
    """1e-307 Mbit/s passes for one byte; the model's own bytes overflow it: refused when
    the clock is set up, before any file."""
    values = merged(TINY, system_model={**LOGNORMAL, "down_mbps": 1e-307, "bandwidth_sigma": 0.0})
    values["output"] = str(tmp_path / "never.h5")
    config = cfg.from_dict(values)
    with pytest.raises(UsageError) as err:
        run_experiment(config, LocalComm(), quiet=True)
    text = str(err.value)
    assert "system_model.down_mbps: 1e-307 makes the virtual clock overflow" in text
    assert "\n" not in text and not (tmp_path / "never.h5").exists()


def test_an_overflowing_value_through_the_cli_exits_2(tmp_path):
    config = write_config(tmp_path / "bad.toml", system_model={**LOGNORMAL, "step_time": 1e308})
    proc = fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "never.h5")])
    assert proc.returncode == 2 and not (tmp_path / "never.h5").exists(), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "system_model.step_time" in proc.stderr
    assert "RuntimeWarning" not in proc.stderr


def test_report_of_an_overflowed_clock_says_inf_not_zero(tmp_path):
    """A file written before the refusal, its clock inf from round 1: `virtual h` and H@x
    say inf (they said 0.00 and -)."""
    path = tmp_path / "inf.h5"
    run_experiment(cfg.from_dict({**merged(TINY, system={"threads": 1}, system_model=LOGNORMAL),
                                  "output": str(path)}), LocalComm(), quiet=True)
    with h5py.File(path, "r+") as f:
        f["rounds"]["virtual_time"][1:] = math.inf
        acc = f["rounds"]["test_acc"][()]
    target = float(np.max(acc[1:]))
    assert acc[0] < target   # reached after round 0, whose clock is 0
    result = CliRunner().invoke(commands, ["report", str(path), "--columns", "hours,vtime",
                                           "--target", repr(target)])
    assert result.exit_code == 0, result.output
    row = result.stdout.splitlines()[2].split()
    assert row[-3:] == ["inf", "(1/1)", "inf"] and "0.00" not in result.stdout
    summary = CliRunner().invoke(commands, ["report", str(path)])
    line = next(x for x in summary.stdout.splitlines() if "virtual time" in x)
    assert "inf h" in line and "0.00" not in line


# ---- resume compares the table that was read ------------------------------------------------

def shuffled(path, lines: list[str], order: list[int]) -> None:
    """The same table, columns in ``order`` and rows reversed."""
    cells = [line.split(",") for line in lines]
    body = [[row[i] for i in order] for row in cells[1:]][::-1]
    write(path, [",".join(cells[0][i] for i in order)] + [",".join(r) for r in body])


def stop(path) -> None:
    """As if the run had died after its last round was flushed."""
    with h5py.File(path, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]


def test_a_resume_takes_the_same_tables_in_another_order_and_names_a_changed_value(tmp_path):
    profiles = [HEADER, *profile_rows()]
    trace = ["client,start,end"] + [f"{c},0,inf" for c in range(12)] + ["3,-5,-1"]
    values = merged(TINY, rounds=3, system={"threads": 1, "checkpoint_every": 1},
                    system_model={"profiles": "file", "step_time": 0.05,
                                  "profile_file": write(tmp_path / "p.csv", profiles),
                                  "availability": "trace",
                                  "availability_file": write(tmp_path / "t.csv", trace)})
    ref, crashed = tmp_path / "ref.h5", tmp_path / "crashed.h5"
    run_experiment(cfg.from_dict({**values, "output": str(ref)}), LocalComm(), quiet=True)
    crashed.write_bytes(ref.read_bytes())
    stop(crashed)
    shuffled(tmp_path / "p.csv", profiles, [3, 1, 4, 0, 2])
    shuffled(tmp_path / "t.csv", trace, [2, 0, 1])
    resume = {**values, "output": str(crashed)}
    exp = run_experiment(cfg.from_dict(resume), LocalComm(), quiet=True, resume=True)
    assert exp.start > 0   # reordered: the same tables, resumed from the checkpoint
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["virtual_time"], b.rounds()["virtual_time"])
    stop(crashed)
    before = crashed.read_bytes()
    write(tmp_path / "p.csv", [HEADER] + [r.replace("3,1.375,", "3,2.0,") for r in profile_rows()])
    with pytest.raises(UsageError) as err:
        run_experiment(cfg.from_dict(resume), LocalComm(), quiet=True, resume=True)
    assert "the virtual clock's inputs differ from the run's (client 3 speed 1.375 -> 2.0;" \
        in str(err.value)
    write(tmp_path / "p.csv", profiles)
    write(tmp_path / "t.csv", trace[:-1] + ["3,-5,-2"])
    with pytest.raises(UsageError) as err:
        run_experiment(cfg.from_dict(resume), LocalComm(), quiet=True, resume=True)
    assert "the availability trace" in str(err.value) and "availability_file" in str(err.value)
    assert crashed.read_bytes() == before


# ---- a column given twice ---------------------------------------------------------------------

def duplicate_npz(path) -> str:
    """An .npz whose zip holds speed.npy twice (numpy.savez cannot write one; a zip can)."""
    profiles_npz(path, np.arange(12))
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        with pytest.warns(UserWarning, match="Duplicate name"):
            z.writestr("speed.npy", members["speed.npy"])
    return str(path)


@pytest.mark.parametrize("make,message", [
    (lambda d: {"profiles": "file", "profile_file": write(
        d / "p.csv", [HEADER + ",speed"] + [r + ",9" for r in profile_rows()])},
     "system_model.profile_file: {d}/p.csv has the column speed twice (columns 2 and 6)"),
    (lambda d: {"profiles": "file", "profile_file": write(
        d / "p.csv", [HEADER + ",Latency "] + [r + ",9" for r in profile_rows()])},
     "system_model.profile_file: {d}/p.csv has the column latency twice (columns 5 and 6)"),
    (lambda d: {**LOGNORMAL, "availability": "trace", "availability_file": write(
        d / "t.csv", ["client,start,end,end", "0,0,10,5"])},
     "system_model.availability_file: {d}/t.csv has the column end twice (columns 3 and 4)"),
    (lambda d: {"profiles": "file", "profile_file": duplicate_npz(d / "p.npz")},
     "system_model.profile_file: {d}/p.npz has the array speed twice"),
], ids=["profile-csv", "profile-csv-case", "trace-csv", "profile-npz"])
def test_a_column_given_twice_is_refused(tmp_path, make, message):
    assert message.format(d=tmp_path) in refusal(make(tmp_path))
