"""Sweeps (fedmpi.sweep) and `fedmpi sweep`: parsing, cell order, names, validation,
and --run-cell on real tiny runs: fresh, skipped when completed, resumed after SIGUSR1,
and under a real mpirun."""

import itertools
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, fedmpi, mpirun, needs_mpi
from fedmpi import sweep as sweeps
from fedmpi.errors import UsageError
from fedmpi.results import open_run
from helpers import write_config

GRID = """
name = "g"
config = "base.toml"
outdir = "out"

[set]
rounds = 2

[grid]
"algorithm.name" = ["fedavg", "fedprox"]
"partition.alpha" = [0.1, 0.3, 1.0]
seed = [0, 1]
"""
VALUES = [("algorithm.name", ["fedavg", "fedprox"]), ("partition.alpha", [0.1, 0.3, 1.0]),
          ("seed", [0, 1])]


def write_sweep(tmp_path: Path, text: str = GRID, rounds: int = 2) -> Path:
    write_config(tmp_path / "base.toml", rounds=rounds)
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


def cli(tmp_path, *args, timeout=300):
    """`fedmpi sweep ...` in a subprocess, run from the sweep's directory."""
    return fedmpi(["sweep", *args], cwd=tmp_path, timeout=timeout)


# ---- the library ------------------------------------------------------------------------

def test_cells_are_the_product_in_file_order_last_key_fastest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = sweeps.load(write_sweep(tmp_path).name)
    expected = list(itertools.product(*(values for _, values in VALUES)))
    assert len(plan) == len(expected) == 12
    assert [tuple(v for _, v in cell.values) for cell in plan.cells] == expected
    assert [cell.index for cell in plan.cells] == list(range(12))
    cell = plan.cell(7)   # (fedprox, 0.1, 1)
    assert cell.name == "algorithm.name=fedprox,partition.alpha=0.1,seed=1"
    assert cell.output == Path("out/g") / f"{cell.name}.h5"
    config = plan.config(cell)
    assert (config.algorithm.name, config.partition.params["alpha"], config.seed) == ("fedprox", 0.1, 1)
    assert config.rounds == 2 and config.output_path() == cell.output
    # the same file read again gives the same cells: array task ids are stable
    assert sweeps.load("s.toml").cells == plan.cells


def test_set_tables_and_dotted_keys_mean_the_same(tmp_path):
    dotted = write_sweep(tmp_path, 'config = "base.toml"\n[set]\n"train.lr" = 0.2\n[grid]\nseed = [4]\n')
    plan_a = sweeps.load(dotted)
    dotted.write_text('config = "base.toml"\n[set.train]\nlr = 0.2\n[grid]\nseed = [4]\n')
    plan_b = sweeps.load(dotted)
    assert plan_a.cells == plan_b.cells
    assert plan_a.config(plan_a.cell(0)).train.lr == 0.2


def test_example_sweep_sweeps_algorithms_with_their_own_parameters():
    plan = sweeps.load(ROOT / "examples/sweep.toml")
    assert len(plan) == 12 and list(plan.grid) == ["algorithm", "partition.alpha", "seed"]
    fedavg, fedacg = plan.config(plan.cell(0)), plan.config(plan.cell(6))
    assert fedavg.algorithm.name == "fedavg" and "lam" not in fedavg.algorithm.params
    assert fedacg.algorithm.name == "fedacg" and fedacg.algorithm.params["lam"] == 0.85
    assert fedacg.data.dataset == "fashion_mnist" and fedacg.clients.num == 100   # the preset
    assert plan.cell(6).name == "algorithm=fedacg-lam_0.85-beta_0.01,partition.alpha=0.1,seed=0"
    assert plan.cell(6).output == Path("runs/fmnist-fedacg") / f"{plan.cell(6).name}.h5"


def test_names_are_filesystem_safe_and_long_ones_hashed():
    assert sweeps.cell_name([("data.data_dir", "/a b/c"), ("model.channels", [4, 8])]) == \
        "data.data_dir=_a_b_c,model.channels=4-8"
    assert sweeps.cell_name([]) == "base"
    long = sweeps.cell_name([("name", "x" * 300)])
    assert len(long) == sweeps.MAX_NAME and long[-9] == "~"
    assert long != sweeps.cell_name([("name", "x" * 299)])


def test_a_plain_config_is_a_sweep_of_one_cell(tmp_path):
    config = write_config(tmp_path / "c.toml", output=str(tmp_path / "mine.h5"))
    plan = sweeps.load(config, overrides=["rounds=1"])
    assert plan.single and len(plan) == 1
    assert plan.cell(0).output == tmp_path / "mine.h5" and plan.cell(0).name == "mine"
    assert sweeps.run_arguments(plan, plan.cell(0)) == [str(config), "--set", "rounds=1"]

    # run, then the config edited: the one cell's file holds another config
    from fedmpi.comm import LocalComm
    from fedmpi.runtime import run_experiment

    run_experiment(plan.config(plan.cell(0)), LocalComm(), quiet=True)
    assert sweeps.config_changes(plan, plan.cell(0)) == []
    write_config(config, output=str(tmp_path / "mine.h5"), train={"lr": 0.2})
    edited = sweeps.load(config, overrides=["rounds=1"])
    assert sweeps.config_changes(edited, edited.cell(0)) == ["train.lr = 0.05 in the file, 0.2 now"]


def test_a_cell_run_before_the_decay_parameter_is_another_config(tmp_path):
    """A FedCM file from before algorithm.decay ran FL-Simulator's placement ("code"):
    under today's default ("matched") its cell holds another config, not a completed run
    of this one (it would have been counted done, its numbers mixed into the table)."""
    import json

    import h5py

    from fedmpi.comm import LocalComm
    from fedmpi.runtime import run_experiment

    config = write_config(tmp_path / "c.toml", output=str(tmp_path / "cm.h5"), rounds=1,
                          algorithm={"name": "fedcm"}, train={"weight_decay": 1e-3})
    plan = sweeps.load(config)
    run_experiment(plan.config(plan.cell(0)), LocalComm(), quiet=True)
    assert sweeps.cell_state(plan, plan.cell(0)) == ("completed", [])
    with h5py.File(tmp_path / "cm.h5", "r+") as f:   # as a file written before the parameter
        values = json.loads(f.attrs["config"])
        del values["algorithm"]["decay"]
        f.attrs["config"] = json.dumps(values)
    assert sweeps.config_changes(plan, plan.cell(0)) == [
        "algorithm.decay = \"code\" in the file, \"matched\" now"]
    pinned = sweeps.load(config, overrides=['algorithm.decay="code"'])
    assert sweeps.config_changes(pinned, pinned.cell(0)) == []


BAD = [
    ('config = "base.toml"\n[grid]\n"algorithm.name" = ["fedavg", "nope"]\n',
     "cell 1 (algorithm.name=nope): config field algorithm.name"),
    ('config = "base.toml"\n[set]\n"train.lrr" = 1\n', "cell 0 (base): config field train.lrr"),
    ('config = "base.toml"\ngrids = 1\n', "unknown key(s) grids; allowed: name, preset"),
    ('config = "base.toml"\npreset = "default"\n', "give exactly one base"),
    ('[grid]\nseed = [1]\n', "give exactly one base"),
    ('config = "nothere.toml"\n', "config file"),
    ('config = "base.toml"\n[grid]\nseed = 3\n', "[grid] seed must be a non-empty list"),
    ('config = "base.toml"\n[grid]\nseed = []\n', "[grid] seed must be a non-empty list"),
    ('config = "base.toml"\n[grid]\noutput = ["a.h5"]\n', "output is set by the sweep"),
    ('config = "base.toml"\n[set]\nseed = 1\n[grid]\nseed = [2]\n', "seed in both [set] and [grid]"),
    ('config = "base.toml"\n[grid]\n"data.data_dir" = ["a/b", "a_b"]\n',
     "cells 0 and 1 both get the name 'data.data_dir=a_b'"),
    ('config = "base.toml"\nname = "a{b}"\n', "name may not contain braces"),
    ('config = "base.toml"\n[grid\n', "not valid TOML"),
    # a grid of 10**9 cells was enumerated cell by cell: --count ran for hours
    ('config = "base.toml"\n[grid]\nseed = [%s]\n"train.lr" = [%s]\n"rounds" = [%s]\n'
     % (",".join(map(str, range(1000))), ",".join(str(i / 1e4) for i in range(1, 1001)),
        ",".join(map(str, range(1, 1001)))),
     "the grid has 1000000000 cells (1000 seed x 1000 train.lr x 1000 rounds); at most 100000 "
     "are allowed, as each is checked whenever the sweep is read: split it into several sweeps"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_sweeps_are_one_line_usage_errors(tmp_path, text, message):
    path = write_sweep(tmp_path, text)
    with pytest.raises(UsageError) as info:
        sweeps.load(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_grid_keys_cannot_be_overridden_from_the_command_line(tmp_path):
    with pytest.raises(UsageError, match="seed is set per cell"):
        sweeps.load(write_sweep(tmp_path), overrides=["seed=3"])


# ---- the command ------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_lists_counts_and_shows_cells(tmp_path):
    write_sweep(tmp_path)
    listing = cli(tmp_path, "s.toml")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].startswith("sweep g: 12 cells over algorithm.name, partition.alpha, seed")
    assert lines[8].split() == ["7", "missing", "algorithm.name=fedprox,partition.alpha=0.1,seed=1"]
    assert cli(tmp_path, "s.toml", "--count").stdout == "12\n"
    one = cli(tmp_path, "s.toml", "--cell", "7", "--outdir", "elsewhere").stdout.split()
    assert one[-1] == "elsewhere/g/algorithm.name=fedprox,partition.alpha=0.1,seed=1.h5"


@pytest.mark.slow
def test_print_args_run_the_cell_then_resume_it(tmp_path):
    write_sweep(tmp_path)
    printed = cli(tmp_path, "s.toml", "--cell", "3", "--print-args")
    args = shlex.split(printed.stdout)
    assert args[:3] == ["base.toml", "--set", "rounds=2"] and args[-2] == "-o"
    fedmpi(["run", "-q", *args], cwd=tmp_path, check=True)
    with open_run(tmp_path / args[-1]) as run:
        assert run.status == "completed"
        assert (run.config["algorithm"]["name"], run.config["partition"]["alpha"],
                run.config["seed"]) == ("fedavg", 0.3, 1)
    again = cli(tmp_path, "s.toml", "--cell", "3", "--print-args").stdout.split()
    assert again == ["--resume", args[-1]]


@pytest.mark.parametrize("args,message", [
    (["s.toml", "--cell", "12"], "no cell 12; it has 12 cell(s), 0..11"),
    (["s.toml", "--count", "--run-cell", "0"], "--count and --run-cell do not go together"),
    (["s.toml", "--print-args"], "--print-args needs --cell I"),
    (["s.toml", "--force"], "--force and --quiet apply to --run-cell I only"),
    (["missing.toml"], "sweep file missing.toml does not exist"),
    (["s.toml", "--set", "seed=1"], "seed is set per cell"),
])
def test_cli_errors_are_one_line_and_exit_2(tmp_path, args, message):
    write_sweep(tmp_path)
    proc = cli(tmp_path, *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("fedmpi: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr


def test_a_bad_cell_stops_the_whole_sweep_before_any_run(tmp_path):
    write_sweep(tmp_path, GRID.replace('"fedprox"]', '"fedprox", "nope"]'))
    proc = cli(tmp_path, "s.toml", "--run-cell", "0")
    assert proc.returncode == 2 and "cell 12 (algorithm.name=nope,partition.alpha=0.1,seed=0)" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_run_cell_runs_once_then_skips(tmp_path):
    write_sweep(tmp_path)
    first = cli(tmp_path, "s.toml", "--run-cell", "4")
    assert first.returncode == 0, first.stderr
    assert "cell 4 (algorithm.name=fedavg,partition.alpha=1.0,seed=0): fresh run" in first.stdout
    output = tmp_path / "out/g/algorithm.name=fedavg,partition.alpha=1.0,seed=0.h5"
    with open_run(output) as run:
        assert run.status == "completed" and run.rounds()["round"].tolist() == [0, 1, 2]
        assert run.config["partition"]["alpha"] == 1.0 and run.config["seed"] == 0
    stamp = output.stat().st_mtime_ns
    second = cli(tmp_path, "s.toml", "--run-cell", "4")
    assert second.returncode == 0 and "completed" in second.stdout and "nothing to do" in second.stdout
    assert output.stat().st_mtime_ns == stamp
    assert cli(tmp_path, "s.toml").stdout.splitlines()[5].split()[:2] == ["4", "completed"]

    # the sweep edited since (names follow the grid only): never resumed or called
    # complete under the new config
    (tmp_path / "s.toml").write_text(GRID.replace("rounds = 2", "rounds = 3"))
    edited = cli(tmp_path, "s.toml", "--run-cell", "4")
    assert edited.returncode == 2 and edited.stdout == "", edited.stderr
    assert edited.stderr == (
        "fedmpi: sweep s.toml, cell 4 (algorithm.name=fedavg,partition.alpha=1.0,seed=0): "
        "out/g/algorithm.name=fedavg,partition.alpha=1.0,seed=0.h5 holds a run of another "
        "config (rounds = 2 in the file, 3 now); restore the sweep to continue that run, or "
        "pass --force to start afresh over it (another sweep name or outdir keeps both)\n")
    assert output.stat().st_mtime_ns == stamp
    shown = cli(tmp_path, "s.toml", "--cell", "4").stdout.splitlines()
    assert shown[0].split()[:2] == ["4", "changed"]
    assert shown[1].strip() == "its file holds a run of another config: rounds = 2 in the file, 3 now"
    plan = sweeps.load(tmp_path / "s.toml", outdir=str(tmp_path / "out"))
    assert sweeps.config_changes(plan, plan.cell(4)) == ["rounds = 2 in the file, 3 now"]
    assert sweeps.config_changes(plan, plan.cell(5)) == []   # no file: nothing to compare


def _wait_for_rounds(path: Path, n: int, proc, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists():
            try:
                with open_run(path) as run:
                    if (run.rounds()["round"] >= 1).sum() >= n:   # trained rounds: not round 0
                        return
            except (UsageError, OSError):   # the file is still being created
                pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {n} round(s); process returned {proc.poll()}")


@pytest.mark.slow
def test_run_cell_resumes_after_a_preemption_signal(tmp_path):
    # enough rounds that the signal lands mid-run: it is sent within ~50 ms of round 1
    write_sweep(tmp_path, GRID.replace("rounds = 2", "rounds = 12"))
    output = tmp_path / "out/g/algorithm.name=fedavg,partition.alpha=0.1,seed=0.h5"
    proc = subprocess.Popen([sys.executable, "-m", "fedmpi", "sweep", "s.toml", "--run-cell", "0", "-q"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_rounds(output, 1, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    with open_run(output) as run:
        assert run.status == "interrupted"
        done = int(run.rounds()["round"][-1])
    assert 1 <= done < 12
    resumed = cli(tmp_path, "s.toml", "--run-cell", "0")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming (interrupted)" in resumed.stdout
    with open_run(output) as run:
        assert run.status == "completed"
        assert list(run.rounds()["round"]) == list(range(0, 13))
        assert [entry["round"] for entry in run.attrs["resumes"]] == [done]


@pytest.mark.slow
@needs_mpi
def test_run_cell_under_mpirun_every_rank_takes_the_same_path(tmp_path):
    write_sweep(tmp_path)
    command = [sys.executable, "-m", "fedmpi", "sweep", str(tmp_path / "s.toml"), "--run-cell", "9",
               "--outdir", str(tmp_path / "out")]
    first = mpirun(3, command, timeout=300)
    assert first.stdout.count("fresh run") == 1   # rank 0 speaks for all
    output = tmp_path / "out/g/algorithm.name=fedprox,partition.alpha=0.3,seed=1.h5"
    with open_run(output) as run:
        assert run.status == "completed" and run.attrs["world_size"] == 3
    again = mpirun(3, command, timeout=300)
    assert again.stdout.count("nothing to do") == 1
