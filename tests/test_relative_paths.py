"""A config's relative paths (`data.path = "d.npz"`) point from the directory the run
started in. `fedmpi run --resume` and `fedmpi evaluate` from another directory (a login
shell in $HOME, a requeued job with another working directory) read them from there too:
they said the data did not exist, or, where a file of the same name was in the new
directory, that the data differed."""

import os

import h5py
import numpy as np
import pytest

from fedmpi.results import RunFile
from fedmpi.runtime.probes import evaluate_file

from conftest import fedmpi
from helpers import TINY, write_config


def _arrays(path, seed, images=False):
    rng = np.random.default_rng(seed)
    shape = (400, 1, 16, 16) if images else (400, 8)
    x = rng.integers(0, 256, shape).astype(np.uint8) if images else \
        rng.normal(size=shape).astype(np.float32)
    y = rng.integers(0, 4, 400)
    np.savez(path, x_train=x[:300], y_train=y[:300], x_test=x[300:], y_test=y[300:])


def _experiment(tmp_path, base=TINY, images=False, **sections):
    """A folder with a dataset and a config that names it relatively; and another folder,
    holding a file of the same name with other data."""
    start, other = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    other.mkdir()
    _arrays(start / "d.npz", 0, images)
    _arrays(other / "d.npz", 1, images)
    values = {k: v for k, v in base.items() if k not in ("data", "model")}
    model = {"name": "cnn", "hidden": 32, "channels": [4, 8]} if images else {"name": "mlp"}
    write_config(start / "c.toml", values, data={"dataset": "arrays", "path": "d.npz"},
                 model=model, **sections)
    return start, other


@pytest.mark.parametrize("decoy", [True, False])
def test_resume_from_another_directory_reads_the_runs_relative_paths(tmp_path, decoy):
    start, other = _experiment(tmp_path, rounds=14, clients={"num": 6, "per_round": 3},
                               system={"deterministic": True})
    if not decoy:
        (other / "d.npz").unlink()
    fedmpi(["run", "-q", "c.toml", "-o", "ref.h5"], check=True, cwd=start)
    crashed = start / "crashed.h5"   # as if killed after round 14 was flushed
    crashed.write_bytes((start / "ref.h5").read_bytes())
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
    proc = fedmpi(["run", "--resume", os.path.relpath(crashed, other)], cwd=other)
    assert proc.returncode == 0, proc.stderr
    assert f"results: {crashed}" in proc.stdout    # absolute: the run works from start/
    with RunFile(crashed) as a, RunFile(start / "ref.h5") as b:
        assert a.status == "completed" and a.attrs["resumes"][-1]["round"] == 10
        assert a.rounds()["test_acc"].tolist() == b.rounds()["test_acc"].tolist()
        assert (a.model() == b.model()).all()
        assert a.attrs["cwd"] == str(start)
    assert sorted(p.name for p in other.iterdir()) == (["d.npz"] if decoy else [])


def test_evaluate_from_another_directory_reads_the_runs_relative_paths(tmp_path):
    from test_probes import PROBED

    start, other = _experiment(
        tmp_path, PROBED, images=True, rounds=2, clients={"num": 3, "per_round": 3},
        eval={"every": 2, "probes": ["linear"], "probe_every": 2, "linear_epochs": 20,
              "local_spectra": False})
    fedmpi(["run", "-q", "c.toml", "-o", "run.h5"], check=True, cwd=start)
    here = os.getcwd()
    os.chdir(other)
    try:
        row = evaluate_file(os.path.relpath(start / "run.h5"), ["linear"], [], quiet=True)
        assert os.getcwd() == str(other)   # the library call leaves the caller's directory
    finally:
        os.chdir(here)
    with RunFile(start / "run.h5") as run:
        evals = run.evals()
    assert evals["posthoc"][-1] == 1 and evals["linear_acc"][-1] == row["linear_acc"]
    assert evals["linear_acc"][-1] == evals["linear_acc"][0]   # the same data, the same draws


def test_a_config_files_inputs_point_from_its_folder(tmp_path):
    """`fedmpi run configs/c.toml` from the project root: data.path = "d.npz" is the one
    beside the config file, recorded absolute; outputs still go where the run starts."""
    start, other = _experiment(tmp_path, rounds=1, clients={"num": 3, "per_round": 3})
    (other / "d.npz").unlink()
    proc = fedmpi(["run", "-q", start / "c.toml", "-o", "r.h5"], cwd=other)
    assert proc.returncode == 0, proc.stderr
    with RunFile(other / "r.h5") as run:
        assert run.config["data"]["path"] == str(start / "d.npz")
    # --set paths point from the current directory, as a shell's do
    proc = fedmpi(["config", "--set", "data.dataset=arrays", "--set", "data.path=d.npz",
                   "--set", "model.name=mlp"], cwd=start)
    assert proc.returncode == 0 and 'path = "d.npz"' in proc.stdout, proc.stderr


def test_a_path_found_only_under_the_old_rule_is_one_line_naming_both(tmp_path):
    start, other = _experiment(tmp_path, rounds=1)
    (start / "d.npz").unlink()   # only other/d.npz: where a run from other/ looked before
    proc = fedmpi(["run", start / "c.toml", "-o", "r.h5"], cwd=other)
    assert proc.returncode == 2 and not (other / "r.h5").exists()
    assert proc.stderr == (
        f"fedmpi: config field data.path: 'd.npz' is read relative to the config file's "
        f"folder, as {start / 'd.npz'}, which does not exist ({other / 'd.npz'} does: write "
        f"the path relative to {start / 'c.toml'} or as an absolute path)\n")


def test_a_missing_relative_path_is_named_absolute(tmp_path):
    start, other = _experiment(tmp_path, rounds=1)
    (start / "d.npz").unlink()
    (other / "d.npz").unlink()
    proc = fedmpi(["run", "c.toml", "-o", "r.h5"], cwd=start)
    assert proc.stderr == f"fedmpi: config field data.path: {start / 'd.npz'} does not exist\n"
    proc = fedmpi(["config", "--set", "data.dataset=arrays", "--set", "data.path=nope/d.npz"],
                  cwd=other)
    assert proc.stderr == f"fedmpi: config field data.path: {other / 'nope' / 'd.npz'} does not exist\n"
