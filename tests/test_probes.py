"""Probes of self-supervised encoders into /eval: cadence, columns, spectrum, single
process vs `mpirun -n 3` bitwise, `fedmpi evaluate` on a finished run, resume cuts,
and one-line errors for bad probe settings."""

import json
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile, repair
from fedmpi.results.checkpoint import truncate
from fedmpi.results.lock import holder as lock_holder
from fedmpi.results.writer import append_eval
from fedmpi.runtime import run_experiment
from fedmpi.runtime.probes import evaluate_file

from conftest import fedmpi, mpirun, needs_mpi
from helpers import TINY, merged, write_config

PROBED = {
    "name": "probed", "seed": 5, "rounds": 3,
    "data": {"dataset": "synthetic", "num_train": 800, "num_test": 300, "size": 16},
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "clients": {"num": 4, "per_round": 4},
    "model": {"name": "cnn", "hidden": 32, "channels": [4, 8]},
    "algorithm": {"name": "fedsimclr", "proj_dim": 16, "proj_hidden": 32},
    "train": {"batch_size": 64, "lr": 0.05},
    "eval": {"every": 3, "probes": ["linear", "finetune", "spectrum"], "probe_every": 2,
             "linear_epochs": 200, "finetune_epochs": 2, "finetune_fractions": [0.05, 0.25],
             "local_spectra": True},
    "system": {"deterministic": True, "device": "cpu"},
}
COLUMNS = ["round", "linear_acc", "finetune_5pct_acc", "finetune_25pct_acc", "effective_rank",
           "seconds"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("probes") / "one.h5"
    run_experiment(cfgmod.from_dict(merged(PROBED, output=str(out))), LocalComm(), quiet=True)
    return out


def test_probes_land_in_eval_at_the_cadence_and_the_last_round(single):
    with RunFile(single) as run:
        evals, spectrum = run.evals(), run.spectrum()
    assert list(evals) == COLUMNS
    assert evals["round"].tolist() == [2, 3]
    for column in COLUMNS[1:4]:
        assert np.all((evals[column] >= 0) & (evals[column] <= 1))
    assert evals["linear_acc"][-1] > 0.2        # 10 classes: well above chance
    assert spectrum.shape == (2, 32)            # one row per evaluation, the encoder's width
    assert np.all(np.diff(spectrum, axis=1) <= 0) and np.all(spectrum >= 0)
    assert np.all((evals["effective_rank"] > 1) & (evals["effective_rank"] <= 32))
    with RunFile(single) as run:
        local, clients = run.local_spectra(), run.clients()
    # every participant of a probe round: its local model's spectrum, clients ascending
    for r in (2, 3):
        assert local["client"][local["round"] == r].tolist() == sorted(clients["client"][clients["round"] == r])
    assert local["spectrum"].shape == (len(local["round"]), 32)
    assert not np.array_equal(local["spectrum"][-1], spectrum[-1])   # local != global model


@pytest.mark.slow
@needs_mpi
def test_mpirun_probes_are_bitwise_the_single_process(single, tmp_path):
    config = write_config(tmp_path / "c.toml", PROBED)
    out = tmp_path / "n3.h5"
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)])
    with RunFile(single) as a, RunFile(out) as b:
        for column in COLUMNS[:-1]:
            assert np.array_equal(a.evals()[column], b.evals()[column]), column
        assert np.array_equal(a.spectrum(), b.spectrum())
        for key in ("round", "client", "spectrum"):
            assert np.array_equal(a.local_spectra()[key], b.local_spectra()[key]), key


@pytest.mark.slow
def test_evaluate_a_finished_run_repeats_the_last_probe(single, tmp_path):
    copy = tmp_path / "copy.h5"
    copy.write_bytes(single.read_bytes())
    proc = fedmpi(["evaluate", str(copy), "--probe", "linear", "--probe", "spectrum",
                   "--set", "eval.linear_epochs=200"], check=True)
    assert "linear_acc" in proc.stdout
    with RunFile(copy) as run:
        evals, spectrum = run.evals(), run.spectrum()
    assert evals["round"].tolist() == [2, 3, 3]
    assert evals["posthoc"][-1] == 1 and np.isnan(evals["posthoc"][0])
    assert evals["linear_acc"][-1] == evals["linear_acc"][1]      # same model, same draws
    assert np.isnan(evals["finetune_5pct_acc"][-1])                # not asked for
    np.testing.assert_allclose(spectrum[-1], spectrum[1], rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_ctrl_c_during_evaluate_exits_130_and_leaves_the_file_as_it_was(single, tmp_path):
    """Ctrl-C in any command but `run` (which checkpoints) ends it by the signal (the
    shell's exit 130), at once and silently. click said `Aborted!` and exited 1, as for a
    failure; a KeyboardInterrupt that landed in a finalizer was lost, the probe went on."""
    import signal

    copy = tmp_path / "copy.h5"
    copy.write_bytes(single.read_bytes())
    slow = subprocess.Popen([sys.executable, "-m", "fedmpi", "evaluate", "-q", str(copy),
                             "--probe", "linear", "--set", "eval.linear_epochs=100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while lock_holder(copy) is None:   # past the imports: probing
        assert slow.poll() is None and time.time() < deadline, slow.stderr.read()
        time.sleep(0.05)
    slow.send_signal(signal.SIGINT)
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == -signal.SIGINT and out == err == "", (slow.returncode, out, err)
    assert lock_holder(copy) is None   # a flock goes with its process
    with RunFile(copy) as run, RunFile(single) as before:
        assert run.status == "completed"
        assert run.evals()["round"].tolist() == before.evals()["round"].tolist()


@pytest.mark.slow
@needs_mpi
def test_evaluate_under_mpirun_probes_once(single, tmp_path):
    """`srun fedmpi evaluate` with more tasks than one: the ranks raced for the file's
    lock, the losers exited 2 and took the job with them; launcher rank 0 alone probes."""
    copy = tmp_path / "copy.h5"
    copy.write_bytes(single.read_bytes())
    proc = mpirun(3, [sys.executable, "-m", "fedmpi", "evaluate", str(copy), "--probe", "linear",
                      "--set", "eval.linear_epochs=20"], check=False, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("linear_acc") == 1, proc.stdout + proc.stderr
    with RunFile(copy) as run:
        assert run.evals()["round"].tolist() == [2, 3, 3]


@pytest.mark.slow
def test_evaluate_holds_the_file_against_a_forced_run(single, tmp_path):
    """`fedmpi run --force` onto a file being evaluated would replace it, and the probe row
    of the old run would land in the new run's file: refused while evaluate runs."""
    copy = tmp_path / "copy.h5"
    copy.write_bytes(single.read_bytes())
    before = copy.read_bytes()
    slow = subprocess.Popen([sys.executable, "-m", "fedmpi", "evaluate", "-q", str(copy),
                             "--probe", "linear", "--probe", "spectrum",
                             "--set", "eval.linear_epochs=100000"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while lock_holder(copy) is None:
            assert slow.poll() is None and time.time() < deadline, slow.stderr.read()
            time.sleep(0.05)
        config = write_config(tmp_path / "c.toml", PROBED)
        forced = fedmpi(["run", "-q", str(config), "-o", str(copy), "--force"])
        assert forced.returncode == 2 and forced.stderr == (
            f"fedmpi: results file {copy} is being written by a live run (pid {slow.pid} on "
            f"{socket.gethostname()}); stop that run first, or choose another output with "
            f"-o/--output\n")
        assert copy.read_bytes() == before
    finally:
        slow.kill()
        slow.communicate()
    with pytest.raises(UsageError, match="does not exist"):   # and no directory made for a lock
        evaluate_file(tmp_path / "no" / "such.h5")
    assert not (tmp_path / "no").exists()
    with pytest.raises(UsageError, match="is a directory; give one run's results file"):
        evaluate_file(tmp_path)   # was "does not exist"


def test_eval_rows_after_a_checkpoint_are_cut_on_resume(tmp_path):
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as h5file:
        for r in (2, 4, 6):
            append_eval(h5file, {"round": r, "linear_acc": r / 10}, np.arange(3.0) + r)
        append_eval(h5file, {"round": 7, "linear_acc": 0.7}, None)   # no spectrum this time
        assert np.isnan(h5file["eval/spectrum"][3]).all()
        append_eval(h5file, {"round": 8}, None, {3: np.ones(3), 1: np.zeros(3)})
        assert h5file["local_spectra/client"][:].tolist() == [1, 3]
        truncate(h5file, 4)
        assert h5file["eval/round"][:].tolist() == [2, 4]
        assert h5file["eval/spectrum"].shape == (2, 3)
        assert h5file["local_spectra/spectrum"].shape == (0, 3)


@pytest.mark.parametrize("changes, field", [
    ({"eval": {"probes": ["linear", "tsne"]}}, "eval.probes"),
    ({"eval": {"probes": ["linear"], "finetune_fractions": [0.0]}}, "eval.finetune_fractions"),
    ({"eval": {"probes": ["linear"], "finetune_fractions": ["1%"]}}, "eval.finetune_fractions"),
    ({"eval": {"probes": ["linear"], "linear_epochs": 0}}, "eval.linear_epochs"),
    ({"eval": {"probes": ["linear"], "linear_head": "l2"}}, "eval.linear_head"),
    ({"eval": {"probes": ["linear"], "probe_every": -1}}, "eval.probe_every"),
    ({"eval": {"probes": ["linear"], "local_spectra": True}}, "eval.local_spectra"),
    ({"eval": {"probes": ["linear"]}, "algorithm": {"name": "fedavg"}}, "eval.probes"),
])
def test_bad_probe_settings_name_the_field(changes, field):
    base = merged(PROBED, algorithm={"name": "fedsimclr"})
    values = merged(base, **{k: {**base.get(k, {}), **v} for k, v in changes.items()})
    if changes.get("algorithm", {}).get("name") == "fedavg":
        values["algorithm"] = {"name": "fedavg"}
    with pytest.raises(UsageError, match=field.replace(".", r"\.")):
        cfgmod.from_dict(values)


@pytest.mark.slow
def test_evaluate_refuses_supervised_runs_and_other_fields(tmp_path):
    out = tmp_path / "sup.h5"
    fedmpi(["run", "-q", str(write_config(tmp_path / "t.toml", TINY, rounds=1)), "-o", str(out)],
           check=True)
    proc = fedmpi(["evaluate", str(out)])
    assert proc.returncode == 2 and "supervised" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = fedmpi(["evaluate", str(out), "--set", "train.lr=1"])
    assert proc.returncode == 2 and "eval.<field>" in proc.stderr


@pytest.mark.slow
def test_evaluate_after_an_evaluate_killed_while_it_wrote(single, tmp_path, capfd):
    """An evaluate killed while it appended its row left the finished run's file open for
    writing: the next evaluate ran its probe, then failed on HDF5's "file is already open
    for write" with a traceback. It now repairs the file first, as a resume does, also
    through a symbolic link, and the one-file report names the probes."""
    copy, link = tmp_path / "copy.h5", tmp_path / "latest.h5"
    copy.write_bytes(single.read_bytes())
    link.symlink_to(copy.name)
    # the evaluate killed with the file open; it also stands in for the run that wrote the
    # file, a process gone by now (the fixture's run was this one, which lives on)
    kill = ("import json, os, signal, sys\n"
            "from fedmpi.results import liveness\n"
            "from fedmpi.results.writer import append_eval, reopen\n"
            "f = reopen(sys.argv[1])\n"
            "f.attrs['writer'] = json.dumps(liveness.identity())\n"
            "f.flush()\n"
            "append_eval(f, {'round': 3, 'linear_acc': 0.5}, None)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", kill, str(copy)]).returncode == -9
    assert repair.inspect(copy).open_for_write   # the superblock's flags stayed set
    capfd.readouterr()
    row = evaluate_file(link, ["linear"], ["eval.linear_epochs=20"], quiet=True)
    assert capfd.readouterr().err == (f"fedmpi: {copy} was left open by a writer that died; "
                                      f"continuing from a clean copy (3 rounds)\n")
    assert link.is_symlink()
    with RunFile(copy) as run:
        evals = run.evals()
    assert evals["round"].tolist() == [2, 3, 3] and evals["linear_acc"][-1] == row["linear_acc"]
    from fedmpi.analysis.report import summarize
    assert summarize(copy).splitlines()[-1] == (
        f"probes       linear {100 * row['linear_acc']:.2f}% (round 3, fedmpi evaluate --set "
        f"eval.linear_epochs=20), fine-tune 5% "
        f"{100 * evals['finetune_5pct_acc'][1]:.2f}% (round 3), fine-tune 25% "
        f"{100 * evals['finetune_25pct_acc'][1]:.2f}% (round 3), effective rank "
        f"{evals['effective_rank'][1]:.2f} (round 3)")


def test_evaluate_records_the_settings_it_changed_by_row(single, tmp_path):
    """A probe row of `fedmpi evaluate --set eval.linear_head=standard` is another
    protocol than the run's: the file keeps which settings each such row changed."""
    copy = tmp_path / "copy.h5"
    copy.write_bytes(single.read_bytes())
    plain = evaluate_file(copy, ["linear"], [], quiet=True)
    std = evaluate_file(copy, ["linear"], ["eval.linear_head=standard"], quiet=True)
    with RunFile(copy) as run:
        evals, overrides = run.evals(), run.eval_overrides()
    assert overrides == {2: [], 3: ["eval.linear_head=standard"]}
    assert evals["linear_acc"][2:].tolist() == [plain["linear_acc"], std["linear_acc"]]
    assert plain["linear_acc"] == evals["linear_acc"][1]          # the run's own protocol
    with RunFile(single) as run:
        assert run.eval_overrides() == {}
    for bad in ("{not json", '["eval.linear_head=standard"]', '{"x": []}', '{"2": 5}',
                '{"2": "ab"}'):
        with h5py.File(copy, "r+") as h5file:                        # hand-edited or damaged
            h5file["eval"].attrs["posthoc_overrides"] = bad
        with RunFile(copy) as run, pytest.raises(UsageError, match=(
                r"^results file .* cannot be read \(/eval's posthoc_overrides is not a JSON")):
            run.eval_overrides()
    with h5py.File(copy, "r+") as h5file:
        h5file["eval"].attrs["posthoc_overrides"] = json.dumps(overrides)
    # a table of both runs names the probe that another protocol measured
    from fedmpi.analysis.report import confound_line
    from fedmpi.analysis.runs import Run
    assert confound_line([Run(single), Run(copy)], ["seed"]) == (
        "probes by fedmpi evaluate: linear_acc --set eval.linear_head=standard (1 of 2 runs)")


def test_report_shows_the_probes_and_plot_draws_the_spectrum(single, tmp_path):
    pytest.importorskip("matplotlib")
    out = fedmpi(["report", str(single), "--group-by", "algorithm.name"], check=True).stdout
    for header in ("linear %", "FT@5% %", "FT@25% %", "eff. rank"):
        assert header in out
    with RunFile(single) as run:
        assert f"{100 * run.evals()['linear_acc'][-1]:.2f}" in out
    png = tmp_path / "spectrum.png"
    fedmpi(["plot", str(single), "--spectrum", "-o", str(png)], check=True)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_plot_spectrum_of_runs_without_probes_is_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sup.h5"
    fedmpi(["run", "-q", str(write_config(tmp_path / "t.toml", TINY, rounds=1)), "-o", str(out)],
           check=True)
    proc = fedmpi(["plot", str(out), "--spectrum", "-o", str(tmp_path / "s.png")])
    assert proc.returncode == 2 and "spectrum" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
