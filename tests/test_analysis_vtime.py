"""Time to accuracy on the virtual clock: `fedmpi report`'s H@x and `virtual h` columns and
`fedmpi plot --x vtime`, on real tiny runs with the clock (policies wait_all and deadline)
and one without it.

Expected values are computed here from the raw /rounds datasets with h5py: the virtual
time (s / 3600) at the first evaluated round whose (EMA-smoothed) accuracy reaches the
target, as for R@x.
"""

import csv
import io

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import TINY, merged

from fedmpi import analysis as fa
from fedmpi import config as cfg
from fedmpi.analysis import render
from fedmpi.analysis.cli import commands
from fedmpi.comm import LocalComm
from fedmpi.runtime import run_experiment

PNG = b"\x89PNG\r\n\x1a\n"
CLOCK = {"profiles": "lognormal", "step_time": 0.05}


def _run(directory, name, **over):
    values = merged(TINY, system={"threads": 1}, **over)
    values["output"] = str(directory / f"{name}.h5")
    run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    return directory / f"{name}.h5"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"wait_all", "deadline": runs with the virtual clock, "plain": one without}; the
    deadline is the median participation time of the wait_all run, so it drops some."""
    directory = tmp_path_factory.mktemp("vtime")
    out = {"wait_all": _run(directory, "wait_all", system_model={**CLOCK, "policy": "wait_all"})}
    with h5py.File(out["wait_all"], "r") as f:
        deadline = float(np.median(f["clients"]["vt_end"][()] - f["clients"]["vt_start"][()]))
    out["deadline"] = _run(directory, "deadline",
                           system_model={**CLOCK, "policy": "deadline", "deadline": deadline})
    out["plain"] = _run(directory, "plain")
    return out


def raw(path) -> dict:
    with h5py.File(path, "r") as f:
        return {name: f["rounds"][name][()] for name in f["rounds"]}


def curve(path, smooth=None) -> list[tuple[float, float]]:
    """By hand: (accuracy, EMA-smoothed if asked; virtual seconds) at the evaluated rows."""
    rows, out, level = raw(path), [], None
    for acc, seconds in zip(rows["test_acc"], rows["virtual_time"]):
        if not np.isnan(acc):
            level = acc if level is None or not smooth else smooth * level + (1 - smooth) * acc
            out.append((level, seconds))
    return out


def hours_to(path, target, smooth=None):
    """Virtual hours at the first evaluated row whose (smoothed) accuracy >= target."""
    return next((seconds / 3600 for acc, seconds in curve(path, smooth) if acc >= target), None)


def target_for(runs, smooth=None) -> float:
    """The highest accuracy both clock runs reach (on the smoothed curve with ``smooth``)."""
    return float(min(max(acc for acc, _ in curve(runs[k], smooth)) for k in ("wait_all", "deadline")))


def cli(*args):
    return CliRunner().invoke(commands, [str(a) for a in args])


def csv_rows(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return list(csv.DictReader(io.StringIO(result.stdout)))


def test_the_runs_have_the_clock_and_the_deadline_dropped_clients(runs):
    wait_all, deadline, plain = (raw(runs[k]) for k in ("wait_all", "deadline", "plain"))
    assert wait_all["virtual_time"][0] == 0 and np.all(np.diff(wait_all["virtual_time"]) > 0)
    assert np.nansum(deadline["n_dropped"]) > 0 and np.nansum(wait_all["n_dropped"]) == 0
    assert "virtual_time" not in plain
    assert not fa.metrics.has_virtual_clock(fa.load(runs["plain"])[0])


@pytest.mark.parametrize("smooth", [None, 0.5])
def test_report_hours_to_target_are_the_virtual_time_at_that_round(runs, smooth):
    target = target_for(runs, smooth)
    args = ["report", runs["wait_all"], runs["deadline"], runs["plain"], "--target", repr(target),
            "--format", "csv"] + (["--smooth", smooth] if smooth else [])
    rows = {row["system_model.policy"] + ("" if row["system_model.profiles"] == "lognormal" else "-off"): row
            for row in csv_rows(cli(*args))}
    name = f"hours_to_{target:g}"
    expected = {policy: hours_to(runs[policy], target, smooth) for policy in ("wait_all", "deadline")}
    assert None not in expected.values() and max(expected.values()) > 0   # past round 0
    for policy, hours in expected.items():
        row = rows[policy]
        total = raw(runs[policy])["virtual_time"][-1] / 3600
        assert float(row["virtual_h_mean"]) == pytest.approx(total, rel=1e-12)
        assert row[f"{name}_reached"] == "1"
        assert float(row[f"{name}_mean"]) == pytest.approx(hours, rel=1e-12)
        # the same round as R@x
        rounds = raw(runs[policy])["round"][raw(runs[policy])["virtual_time"] == hours * 3600]
        assert float(row[f"rounds_to_{target:g}_mean"]) in rounds
    plain = rows["wait_all-off"]
    assert plain[f"{name}_mean"] == "" and plain["virtual_h_mean"] == ""
    # a target nobody reaches: (0/1), no mean
    never = csv_rows(cli(*args[:4], "--target", "0.999", "--format", "csv"))
    assert all(row["hours_to_0.999_reached"] == "0" and row["hours_to_0.999_mean"] == "" for row in never)


def test_text_table_shows_hours_by_default_and_dashes_without_a_clock(runs):
    target = target_for(runs)
    result = cli("report", runs["wait_all"], runs["deadline"], runs["plain"], "--target", repr(target))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = f"H@{100 * target:g}%"
    assert header in lines[0] and "virtual h" in lines[0] and f"R@{100 * target:g}%" in lines[0]
    assert lines[0].index(header) < lines[0].index("traffic MB") < lines[0].index("virtual h")
    for key in ("wait_all", "deadline"):
        expected = hours_to(runs[key], target)
        cell = f"{render.hours(expected, None)} (1/1)"
        total = render.hours(raw(runs[key])["virtual_time"][-1] / 3600, None)
        row = next(line for line in lines[2:] if f" {key} " in line and " lognormal " in line)
        assert f"  {cell}  " in row and row.split()[-3] == total   # then kappa, rho
    off = next(line for line in lines[2:] if " off " in line)
    assert off.split()[-3] == "-" and "H@x: virtual hours" in result.stdout
    # no clock, no such columns; --columns picks them like any other
    plain = cli("report", runs["plain"], runs["plain"].parent / "wait_all.h5", "--target", "0.01",
                "--columns", "final,hours,vtime")
    assert plain.exit_code == 0 and plain.stdout.splitlines()[0].split()[-4:] == ["%", "H@1%", "virtual", "h"]
    alone = cli("report", runs["plain"], "--target", "0.01")
    assert alone.exit_code == 0 and "H@" not in alone.stdout and "virtual h" not in alone.stdout


def test_summary_names_the_virtual_time(runs):
    result = cli("report", runs["deadline"])
    rows = raw(runs["deadline"])
    line = next(line for line in result.stdout.splitlines() if line.startswith("virtual time"))
    assert f"{render.hours(rows['virtual_time'][-1] / 3600, None)} h" in line
    assert f"{int(np.nansum(rows['n_dropped']))} clients dropped" in line
    assert "virtual time" not in cli("report", runs["plain"]).stdout


def test_plot_against_virtual_hours(runs, tmp_path):
    out = tmp_path / "vtime.png"
    result = cli("plot", runs["wait_all"], runs["deadline"], "-o", out, "--x", "vtime")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out}\n" and out.read_bytes()[:8] == PNG
    grouped = tmp_path / "grouped.pdf"
    result = cli("plot", runs["wait_all"], runs["deadline"], "-o", grouped, "--x", "vtime",
                 "-g", "system_model.policy", "--smooth", "0.9")
    assert result.exit_code == 0 and grouped.read_bytes()[:5] == b"%PDF-"
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    fa.plot_accuracy(fa.load(runs["wait_all"]), ax, x="vtime")
    rows = raw(runs["wait_all"])
    evaluated = np.isfinite(rows["test_acc"])
    xs, ys = ax.get_lines()[0].get_data()
    np.testing.assert_allclose(xs, rows["virtual_time"][evaluated] / 3600, rtol=1e-12)
    np.testing.assert_allclose(ys, 100 * rows["test_acc"][evaluated], rtol=1e-12)
    assert ax.get_xlabel() == "virtual time (h)"


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    plain, clock = runs["plain"], runs["wait_all"]
    for args, says in (
            (["plot", clock, plain, "-o", tmp_path / "a.png", "--x", "vtime"],
             [f"--x vtime: {plain} has no virtual clock", "system_model.profiles"]),
            (["report", plain, "--columns", "vtime"], ["--columns vtime: no run has a virtual clock"]),
            (["report", plain, "--target", "0.5", "--columns", "final,hours"],
             ["--columns hours: no run has a virtual clock", "system_model.profiles"]),
            (["report", clock, "--columns", "hours"], ["--columns hours needs --target"])):
        result = cli(*args)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith("fedmpi: ") and all(s in result.stderr for s in says), result.stderr
    assert not (tmp_path / "a.png").exists()
