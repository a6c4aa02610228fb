"""`fedmpi plot` (a real PNG per x axis, lines and bands) and `fedmpi watch` (a real run
followed live from another process, and the exit code of each final status)."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import fedmpi
from helpers import write_config
from test_analysis import cli_module, run_cli, write_run

from fedmpi import analysis as fa
from fedmpi.errors import UsageError

PNG = b"\x89PNG\r\n\x1a\n"
NAN = float("nan")


@pytest.fixture
def runs_dir(tmp_path):
    """fedavg and fedacg x 2 seeds; accuracy evaluated on rounds 0 (the initial model, 0.1),
    2, 4, 6."""
    for algorithm, base in (("fedavg", 0.5), ("fedacg", 0.6)):
        for seed in (0, 1):
            acc = [0.1, NAN, base, NAN, base + 0.1, NAN, base + 0.2 + 0.02 * seed]
            config = {"algorithm": {"name": algorithm}, "seed": seed, "rounds": 6,
                      "data": {"dataset": "cifar10"}, "model": {"name": "cnn"}}
            write_run(tmp_path / "runs" / f"{algorithm}-{seed}.h5", acc, config, wall=0.5 + seed,
                      rounds=list(range(7)))
    return tmp_path / "runs"


@pytest.mark.parametrize("x", ["round", "traffic", "time"])
def test_plot_writes_a_png_for_each_x_axis(runs_dir, tmp_path, x):
    out = tmp_path / f"acc-{x}.png"
    proc = run_cli(["plot", runs_dir, "-o", out, "--x", x])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote {out}\n" and out.read_bytes()[:8] == PNG
    grouped = tmp_path / f"grouped-{x}.png"
    proc = run_cli(["plot", runs_dir, "-o", grouped, "--x", x, "-g", "algorithm.name", "--smooth", "0.9"])
    assert proc.returncode == 0, proc.stderr
    assert grouped.read_bytes()[:8] == PNG


def test_plot_lines_labels_and_group_bands(runs_dir):
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    runs = fa.load(runs_dir)
    ax = Figure().add_subplot()
    fa.plot_accuracy(runs, ax, x="traffic")
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["fedacg, seed=0", "fedacg, seed=1", "fedavg, seed=0", "fedavg, seed=1"]
    xs, ys = ax.get_lines()[0].get_data()
    # round 0 (the initial model) sends nothing, then 2 MB a round
    assert xs.tolist() == [0.0, 4.0, 8.0, 12.0] and ys.tolist() == pytest.approx([10, 60, 70, 80])
    ax = Figure().add_subplot()
    fa.plot_accuracy(runs, ax, x="time", group_by=["algorithm.name"])
    assert [line.get_label() for line in ax.get_lines()] == ["fedacg (n=2)", "fedavg (n=2)"]
    xs, ys = ax.get_lines()[1].get_data()
    assert xs.tolist() == pytest.approx([1.0, 3.0, 5.0, 7.0])  # mean of 0.5 s and 1.5 s a row, cumulative
    assert ys.tolist() == pytest.approx([10, 50, 60, 71])
    band = [c for c in ax.collections if isinstance(c, matplotlib.collections.PolyCollection)]
    assert len(band) == 2
    top = band[1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(71 + 100 * np.std([0.70, 0.72], ddof=1))
    assert fa.plot.default_title(runs) == "cifar10, cnn"


def test_plot_names_runs_as_a_paper_does_and_puts_a_long_legend_beside_the_axes(runs_dir):
    """--paper: the paper's method names (the seed where runs differ in it); more than
    eight lines: twenty colours and the legend outside the axes; a key a run lacks is
    left out of its label rather than printed as '-'."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    runs = fa.load(runs_dir)
    ax = Figure().add_subplot()
    fa.plot_accuracy(runs, ax, paper="fedacg")
    assert [line.get_label() for line in ax.get_lines()] == [
        "FedACG, seed=0", "FedACG, seed=1", "FedAvg, seed=0", "FedAvg, seed=1"]
    assert ax.get_legend().get_bbox_to_anchor().x0 < ax.get_window_extent().x1   # inside
    many = Figure().add_subplot()
    fa.plot_accuracy(runs * 3, many, paper="fedacg")   # the same name twice: keys added
    labels = [line.get_label() for line in many.get_lines()]
    assert labels[0] == "FedACG, seed=0 (fedacg, seed=0)" and len(labels) == 12
    assert len({line.get_color() for line in many.get_lines()}) == 12
    assert many.get_legend().get_bbox_to_anchor().x0 > many.get_window_extent().x1   # beside
    with pytest.raises(UsageError, match=r"^--paper 'nope': allowed are fedacg, "):
        fa.plot_accuracy(runs, Figure().add_subplot(), paper="nope")
    with pytest.raises(UsageError, match=r"^--paper names runs one by one"):
        fa.plot_accuracy(runs, Figure().add_subplot(), group_by=["seed"], paper="fedacg")

    class Lacking:   # a run of another method, without this one's parameter
        completed = True

        def get(self, key):
            return {"algorithm.name": "fedavg", "seed": 0}.get(key)
    label = fa.plot._label(Lacking(), ["algorithm.name", "algorithm.lam", "seed"])
    assert label == "fedavg, seed=0"


@pytest.mark.slow
def test_plot_bad_input_is_one_line_and_exit_2(runs_dir, tmp_path):
    for args, says in ((["plot", runs_dir], "needs -o FILE"),
                       (["plot", runs_dir, "-o", tmp_path / "a.png", "--x", "speed"], "--x 'speed'"),
                       (["plot", runs_dir, "-o", tmp_path / "a.nope"], "must end in a format"),
                       (["plot", runs_dir, "-o", tmp_path / "a.png", "-g", "lr"], "config key 'lr'")):
        proc = run_cli(args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    runs, pipe = fa.load(runs_dir), tmp_path / "p.png"
    os.mkfifo(pipe)
    for path, says in ((tmp_path / "no" / "a.png", f"cannot be written ({tmp_path / 'no'} is not a folder)"),
                       (pipe, "cannot be written (File or stream is not seekable.)")):
        with pytest.raises(UsageError, match=f"^plot file {re.escape(str(path))} {re.escape(says)}$"):
            fa.plot.save_plot(runs, path)


def test_plot_y_from_starts_the_accuracy_axis_there(runs_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    made = []
    make = fa.plot.figures.new_figure
    monkeypatch.setattr(fa.plot.figures, "new_figure", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    runs = fa.load(runs_dir)
    fa.plot.save_plot(runs, tmp_path / "a.png", y_from=0.6)
    low, high = made[-1].axes[0].get_ylim()
    assert low == 60 and 82 < high < 90    # the data's top (82%) plus matplotlib's margin
    fa.plot.save_plot(runs, tmp_path / "b.png", y_from=1.0)   # above every point: not inverted
    assert made[-1].axes[0].get_ylim() == (100, 101)
    proc = run_cli(["plot", runs_dir, "-o", tmp_path / "c.png", "--y-from", "60%"])
    assert proc.returncode == 0 and (tmp_path / "c.png").read_bytes()[:8] == PNG, proc.stderr
    for args, says in ((["--y-from", "1.5"], "--y-from '1.5': give a fraction in (0, 1]"),
                       (["--y-from", "nan"], "--y-from"),
                       (["--y-from", "0.6", "--spectrum"], "--y-from is for accuracy curves")):
        proc = run_cli(["plot", runs_dir, "-o", tmp_path / "d.png", *args])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "d.png").exists()


def test_plot_without_matplotlib_says_how_to_get_it(runs_dir, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; "  # makes `import matplotlib` fail
            "from fedmpi.analysis.cli import commands; commands(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "plot", str(runs_dir), "-o", str(tmp_path / "a.png")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "fedmpi: fedmpi plot needs matplotlib: pip install matplotlib\n"


@pytest.mark.slow
def test_watch_follows_a_real_run_until_it_completes(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=8, data={"num_train": 1200},
                          train={"local_epochs": 2})
    out = tmp_path / "live.h5"
    cmd = [sys.executable, "-m", cli_module("watch"), "watch", str(out), "--wait", "--interval", "0.2"]
    watcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = fedmpi(["run", config, "-q", "-o", out], timeout=300)
    assert run.returncode == 0, run.stderr
    finished = time.monotonic()
    stdout, stderr = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, stderr
    assert time.monotonic() - finished < 30
    assert stderr in ("", f"fedmpi: waiting for {out} to appear...\n")
    lines = stdout.splitlines()
    assert lines[0] == f"watching {out}: fedavg on synthetic, 8 rounds, running"
    rounds = [line for line in lines if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == [f"{r}/8" for r in range(0, 9)]  # 0: initial model
    assert "initial model  test_acc" in rounds[0] and "s/round" not in rounds[0]
    assert rounds[1].endswith("running") and "test_acc" in rounds[1] and "s/round  eta" in rounds[1]
    acc = fa.load(out)[0].rounds["test_acc"]
    assert lines[-1].startswith(f"completed: 8/8 rounds, final test_acc {acc[-1]:.4f} (best {acc.max():.4f})")


@pytest.mark.parametrize("status, code, says", [
    ("completed", 0, "completed: 3/3 rounds, final test_acc 0.3000 (best 0.3000), 6 s of training"),
    ("failed", 1, "failed at round 3 after 3/3 rounds: loss is NaN"),
    ("interrupted", 75, "interrupted after 3/3 rounds; continue with: fedmpi run --resume "),
    ("running", 0, "round    3/3  train_loss 0.3333  test_acc 0.3000  2.00 s/round  eta 0 s  running"),
])
def test_watch_once_shows_the_state_and_exits_with_the_status_code(tmp_path, status, code, says):
    extra = {"failed_round": 3, "error": "loss is NaN"} if status == "failed" else {}
    path = write_run(tmp_path / "r.h5", [0.1, 0.2, 0.3], status=status, **extra)
    proc = run_cli(["watch", path, "--once"])
    assert proc.returncode == code, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"watching {path}: fedavg on ?, 3 rounds, {status}"
    assert lines[-1].startswith(says)
    assert len(lines) == (2 if status == "running" else 3)


def test_watch_bad_input_exits_2(tmp_path):
    (tmp_path / "x.h5").write_text("x")
    # a missing file is waited for (a job still queued), but not with --once
    for args, says in (([tmp_path / "none.h5", "--once"], "does not exist"),
                       ([tmp_path / "x.h5"], "not an HDF5 file"),
                       ([tmp_path / "x.h5", "--interval", "0"], "--interval 0"),
                       # both were "does not exist"
                       ([tmp_path], f"results file {tmp_path} is a directory; give one run's results file"),
                       (["/dev/null"], "results file /dev/null is not a regular file (a device, a pipe")):
        proc = run_cli(["watch", *args])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr
