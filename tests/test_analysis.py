"""fedmpi.analysis on real tiny runs, on files with chosen curves, and on every archived file.

Real runs: FedAvg and FedAvgM x 2 seeds of the TINY config, made once for the module by
`fedmpi run` in subprocesses. Expected values are computed here from the raw HDF5
datasets with h5py, not through the reader under test. Files with chosen accuracy
curves are written with the real ResultsWriter. The helpers at the top are shared by
test_report_tables.py and test_plot_watch.py.
"""

import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import fedmpi
from helpers import write_config

from fedmpi import analysis as fa
from fedmpi.errors import UsageError
from fedmpi.results import ResultsWriter
from fedmpi.results.schema import CLIENT_FIELDS, ROUND_FIELDS

DATA = Path(__file__).parent / "data"
NAN = float("nan")
ALGORITHMS, SEEDS = ("fedavg", "fedavgm"), (1, 2)


# ---- helpers shared with the other analysis test modules ---------------------------

def make_tiny_runs(directory: Path, algorithms=ALGORITHMS, seeds=SEEDS, rounds=4, every=2) -> list[Path]:
    """Real `fedmpi run`s of TINY; returns the results files."""
    config = write_config(directory / "tiny.toml", rounds=rounds, eval={"every": every, "batch_size": 64})
    outputs = []
    for algorithm in algorithms:
        for seed in seeds:
            outputs.append(directory / "runs" / f"{algorithm}-seed{seed}.h5")
            fedmpi(["run", config, "-q", "-o", outputs[-1], "--set", f"algorithm.name={algorithm}",
                    "--set", f"seed={seed}", "--set", "system.threads=1"], timeout=300, check=True)
    return sorted(outputs)


def cli_module(command: str) -> str:
    """The module that serves ``command``: ``fedmpi`` when fedmpi/cli.py registers the
    analysis commands; until then the very same click commands in fedmpi.analysis.cli."""
    from fedmpi.analysis import cli as analysis_cli
    from fedmpi.cli import main
    mine = analysis_cli.commands.commands.get(command)
    return "fedmpi" if main.commands.get(command) is mine else "fedmpi.analysis.cli"


def run_cli(args, timeout=120, module=None):
    """`fedmpi <command> ...` (the module: cli_module)."""
    return fedmpi(args, timeout=timeout, module=module or cli_module(args[0]))


def write_run(path: Path, acc, config=None, status="completed", bytes_per_round=1_000_000,
              wall=2.0, rounds=None, **status_attrs) -> Path:
    """A results file with a chosen accuracy curve (NaN = not evaluated), written by the
    real ResultsWriter: 1 MB down + 1 MB up and ``wall`` seconds per round. A round 0 in
    ``rounds`` is the initial model's row, as the runtime writes it: no traffic, no
    training loss, no client rows."""
    config = config or {"algorithm": {"name": "fedavg"}, "seed": 0, "rounds": len(acc)}
    ids = rounds or list(range(1, len(acc) + 1))
    with ResultsWriter.create(path, config=config, provenance={"world_size": 1},
                              round_fields=list(ROUND_FIELDS), client_fields=list(CLIENT_FIELDS),
                              layout=[], partition={}) as writer:
        for r, a in zip(ids, acc):
            sent = bytes_per_round if r else 0
            writer.append_round({"round": r, "test_acc": a, "train_loss": 1.0 / r if r else NAN,
                                 "time_wall": wall, "fl_bytes_down": sent, "fl_bytes_up": sent})
            if r:
                writer.append_clients({"round": np.array([r, r]), "client": np.array([0, 1])})
            writer.flush()
        writer.set_status(status, **status_attrs)
    return path


def raw_rounds(path) -> dict:
    """The /rounds columns straight from h5py, for expected values."""
    with h5py.File(path, "r") as f:
        return {name: f["rounds"][name][()] for name in f["rounds"]}


def last_finite(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return finite[-1] if finite else NAN


# ---- real tiny runs ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("analysis")
    return make_tiny_runs(directory)


def test_importing_the_analysis_api_needs_neither_torch_nor_mpi():
    code = ("import sys, fedmpi.analysis, fedmpi.analysis.cli, fedmpi.analysis.report; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_run_exposes_config_rows_and_partition(tiny):
    run = fa.load(tiny[0])[0]
    assert run.path == tiny[0] and run.status == "completed" and run.completed
    assert run.get("algorithm.name") == "fedavg" and run.get("train.lr") == 0.05
    assert run.get("seed") == 1 and run.get("no.such.key") is None and run.get("no.such", 7) == 7
    assert run.config["clients"]["per_round"] == 5 and run.attrs["world_size"] == 1
    assert run.rounds["round"].tolist() == [0, 1, 2, 3, 4] and run.n_rounds == 4   # 0: initial model
    assert len(run.clients["client"]) == 4 * 5
    assert set(run.ranks["rank"].tolist()) == {0}
    assert run.partition["client_sizes"].sum() == 600 and len(run.partition["client_sizes"]) == 12


def test_metrics_match_values_computed_from_the_raw_file(tiny):
    for path in tiny:
        run, raw = fa.load(path)[0], raw_rounds(path)
        acc = raw["test_acc"]   # rounds 0 (the initial model), 1, ..., 4
        assert raw["round"].tolist() == [0, 1, 2, 3, 4]
        assert np.isnan(acc[[1, 3]]).all() and np.isfinite(acc[[0, 2, 4]]).all()  # eval.every = 2
        assert fa.accuracy_at(run, 0) == fa.accuracy_at(run, 1) == acc[0]
        assert fa.accuracy_at(run, 2) == fa.accuracy_at(run, 3) == acc[2]
        assert fa.accuracy_at(run, 4) == fa.final_accuracy(run) == acc[4]
        assert math.isnan(fa.accuracy_at(run, 5))  # never reached
        assert fa.best_accuracy(run) == max(acc[[0, 2, 4]])
        for target in (acc[0], acc[2], acc[4], 1.01):
            first = next((int(r) for r, a in zip(raw["round"], acc) if a >= target), None)
            assert fa.rounds_to(run, target) == first, target
        assert fa.rounds_to(run, acc[0]) == 0
        with h5py.File(path, "r") as f:
            d = int(f.attrs["num_params"])
        assert fa.total_traffic_mb(run) == pytest.approx(4 * 5 * 2 * d * 4 / 1e6)  # rounds x S x 2 x d x 4 B
        wall = float(np.sum(raw["time_wall"]))
        assert fa.wall_time(run) == pytest.approx(wall)
        assert fa.kappa(run) == pytest.approx(acc[4] * 1e4 / wall)
        assert fa.rho(run) == pytest.approx(acc[4] * 1e4 / (4 * 5 * 2 * d * 4 / 1e6))


def test_rounds_and_clients_tables_are_tidy(tiny):
    runs = fa.load(tiny[0].parent)
    rounds = fa.rounds_table(runs)
    assert list(rounds)[:4] == ["run", "status", "seed", "algorithm.name"]
    assert {len(c) for c in rounds.values()} == {4 * 5}   # rounds 0-4 of 4 runs
    assert sorted(set(rounds["algorithm.name"])) == list(ALGORITHMS)
    assert rounds["seed"].dtype == np.int64 and set(rounds["status"]) == {"completed"}
    first = rounds["run"] == str(tiny[0])
    expected = raw_rounds(tiny[0])["test_acc"].tolist()
    assert rounds["test_acc"][first].tolist() == pytest.approx(expected, nan_ok=True)
    assert rounds["cum_fl_mb"][first][-1] == pytest.approx(fa.total_traffic_mb(runs[0]))
    clients = fa.clients_table(runs, keys=["algorithm.name", "train.lr"])
    assert {len(c) for c in clients.values()} == {4 * 4 * 5}
    assert set(clients["train.lr"]) == {0.05} and "bytes_up" in clients
    pd = pytest.importorskip("pandas", reason="pandas is optional; the tables are plain numpy")
    frame = pd.DataFrame(rounds)
    assert frame.groupby("algorithm.name").size().tolist() == [10, 10]
    assert len(pd.DataFrame(fa.group_table(runs))) == 2 and len(pd.DataFrame(clients)) == 80


def test_group_table_means_and_sample_std_over_seeds(tiny):
    runs = fa.load(tiny)
    rows = fa.group_table(runs, at=[2])
    assert [r["algorithm.name"] for r in rows] == list(ALGORITHMS) and [r["n"] for r in rows] == [2, 2]
    for row in rows:
        finals = [last_finite(raw_rounds(p)["test_acc"]) for p in tiny
                  if p.name.split("-")[0] == row["algorithm.name"]]
        assert row["final_acc_mean"] == pytest.approx(np.mean(finals))
        assert row["final_acc_std"] == pytest.approx(np.std(finals, ddof=1))
        assert "acc@2_mean" in row and row["status"] == "completed"


def test_load_finds_runs_recursively_and_skips_other_files(tiny, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(tiny[0].parent, tree / "a" / "b")
    (tree / "notes.h5").write_text("not hdf5")
    with h5py.File(tree / "a" / "other.h5", "w") as f:
        f["x"] = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = fa.load(tree)
    assert len(runs) == 4 and sorted(str(w.message).split(":")[0] for w in caught) == \
        sorted([f"skipping {tree / 'a' / 'other.h5'}", f"skipping {tree / 'notes.h5'}"])
    assert all(issubclass(w.category, fa.SkippedFileWarning) for w in caught)
    with pytest.raises(UsageError, match="not a fedmpi results file"):
        fa.load(tree, strict=True)
    with pytest.raises(UsageError, match="notes.h5 is not an HDF5 file"):
        fa.load(tree / "notes.h5")  # named explicitly: an error, not a warning
    assert len(fa.load(str(tree / "**" / "fedavg-*.h5"))) == 2
    assert len(fa.load([tiny[0], tiny[0]])) == 1
    with pytest.raises(UsageError, match="does not exist"):
        fa.load(tree / "missing.h5")
    with pytest.raises(UsageError, match="no fedmpi results files"):
        fa.load(str(tree / "*.nothing"))


# ---- chosen curves ----------------------------------------------------------------

def test_ema_rounds_to_on_a_known_curve(tmp_path):
    """a = 0.5 then 0.9 forever, evaluated every 2nd round: s_k = 0.9 - 0.4 * 0.9^(k-1)
    reaches 0.8 first at k = 15 (0.9^14 = 0.229 <= 0.25 < 0.9^13), i.e. round 30."""
    acc = [NAN if r % 2 else (0.5 if r == 2 else 0.9) for r in range(1, 41)]
    run = fa.load(write_run(tmp_path / "curve.h5", acc))[0]
    assert fa.rounds_to(run, 0.8) == 4
    assert fa.rounds_to(run, 0.8, smooth=0.9) == 30
    smoothed = fa.accuracy_curve(run, smooth=0.9)[1]
    assert smoothed[:3].tolist() == pytest.approx([0.5, 0.54, 0.576])
    assert fa.accuracy_at(run, 29, smooth=0.9) == pytest.approx(0.9 - 0.4 * 0.9 ** 13)
    assert fa.final_accuracy(run, smooth=0.9) == pytest.approx(0.9 - 0.4 * 0.9 ** 19)
    assert fa.best_accuracy(run) == 0.9
    assert fa.best_accuracy(run, smooth=0.9) == fa.final_accuracy(run, smooth=0.9)  # still rising


def test_round_zero_starts_the_curve_and_is_not_a_completed_round(tmp_path):
    """Initial model 0.1, then 0.5, (not evaluated), 0.9; EMA(0.5) from round 0:
    0.1, 0.3, 0.6."""
    run = fa.load(write_run(tmp_path / "r0.h5", [0.1, 0.5, NAN, 0.9], rounds=[0, 1, 2, 3]))[0]
    assert run.n_rounds == 3 and fa.summary(run)["rounds_done"] == 3
    ids, smoothed = fa.accuracy_curve(run, smooth=0.5)
    assert ids.tolist() == [0, 1, 3] and smoothed.tolist() == pytest.approx([0.1, 0.3, 0.6])
    assert fa.rounds_to(run, 0.1) == 0 and fa.rounds_to(run, 0.5) == 1
    assert fa.rounds_to(run, 0.5, smooth=0.5) == 3 and fa.rounds_to(run, 0.7, smooth=0.5) is None
    assert fa.accuracy_at(run, 0) == 0.1 and fa.accuracy_at(run, 2) == 0.5
    assert fa.final_accuracy(run) == fa.best_accuracy(run) == 0.9
    assert fa.cumulative_traffic_mb(run).tolist() == [0, 2, 4, 6] and fa.total_traffic_mb(run) == 6
    assert fa.cumulative_time(run).tolist() == [2, 4, 6, 8]
    row = fa.group_table([run], targets=[0.1, 0.5])[0]
    assert (row["rounds_to_0.1_mean"], row["rounds_to_0.1_reached"]) == (0, 1)
    assert row["rounds_to_0.5_mean"] == 1
    only = fa.load(write_run(tmp_path / "start.h5", [0.1], rounds=[0], status="interrupted"))[0]
    assert only.n_rounds == 0 and fa.summary(only)["rounds_done"] == 0
    assert math.isnan(fa.accuracy_at(only, 1)) and fa.final_accuracy(only) == 0.1


def test_fnrfl_efficiency_numbers(tmp_path):
    """FNR-FL's feature-skew row: acc 0.9976, 8920 MB, kappa 1.6462 at 6060 s, rho 1.1184."""
    path = write_run(tmp_path / "fnr.h5", [NAN] * 9 + [0.9976], bytes_per_round=446_000_000, wall=606.0)
    run = fa.load(path)[0]
    assert fa.total_traffic_mb(run) == pytest.approx(8920)
    assert fa.wall_time(run) == pytest.approx(6060)
    assert round(fa.kappa(run), 4) == 1.6462 and round(fa.rho(run), 4) == 1.1184


def test_rows_a_resume_reran_are_superseded(tmp_path):
    """Rounds 1-3 written, resumed from a checkpoint after round 1: rounds 2-4 again."""
    path = write_run(tmp_path / "resumed.h5", [0.1, 0.2, 0.3, 0.25, 0.35, 0.45], rounds=[1, 2, 3, 2, 3, 4])
    run = fa.load(path)[0]
    assert run.rounds["round"].tolist() == [1, 2, 3, 4]
    assert run.rounds["test_acc"].tolist() == [0.1, 0.25, 0.35, 0.45]
    assert run.clients["round"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert fa.wall_time(run) == 8.0 and fa.total_traffic_mb(run) == 8.0


def test_runs_that_did_not_complete_are_flagged_and_kept_apart(tmp_path):
    config = {"algorithm": {"name": "fedavg"}, "seed": 0, "rounds": 4}
    write_run(tmp_path / "done.h5", [0.1, 0.2, 0.3, 0.4], config)
    write_run(tmp_path / "cut.h5", [0.1, 0.2], {**config, "seed": 1}, status="interrupted")
    runs = fa.load(tmp_path)
    table = fa.rounds_table(runs)
    assert table["status"].tolist() == ["interrupted"] * 2 + ["completed"] * 4
    rows = fa.group_table(runs)
    assert [(r["status"], r["n"], r["final_acc_mean"]) for r in rows] == \
        [("completed", 1, 0.4), ("interrupted", 1, 0.2)]
    assert [r["status"] for r in fa.runs_table(runs)] == ["interrupted", "completed"]


def test_differing_keys_ignore_labels_and_keys_of_one_algorithm(tmp_path):
    base = {"name": "x", "seed": 0, "output": "a.h5", "system": {"threads": 1}, "partition": {"alpha": 0.3}}
    write_run(tmp_path / "a.h5", [0.1], {**base, "algorithm": {"name": "fedavg"}})
    write_run(tmp_path / "b.h5", [0.1], {**base, "name": "y", "seed": 1, "output": "b.h5", "system": {"threads": 2},
                                         "algorithm": {"name": "fedprox", "mu": 0.01}})
    write_run(tmp_path / "c.h5", [0.1], {**base, "partition": {"alpha": 0.6},
                                         "algorithm": {"name": "fedavg"}})
    runs = fa.load(tmp_path)
    assert fa.differing_keys(runs) == ["algorithm.name", "partition.alpha"]
    assert fa.group_keys(runs) == ["algorithm.name", "partition.alpha"]
    with pytest.raises(UsageError, match="did you mean 'partition.alpha'"):
        fa.group_table(runs, ["partiton.alpha"])
    mu = fa.rounds_table(runs, keys=["algorithm.mu"])["algorithm.mu"]
    assert np.isnan(mu[0]) and mu[1] == 0.01


# ---- archived files of every schema version ----------------------------------------

@pytest.mark.parametrize("path", sorted(DATA.glob("*.h5")), ids=lambda p: p.name)
def test_every_archived_results_file_still_analyses(path, tmp_path):
    from fedmpi.analysis.report import report_table, summarize

    runs = fa.load(path)
    run = runs[0]
    assert run.status == "completed" and run.n_rounds >= 1
    expected = raw_rounds(path)
    assert fa.final_accuracy(run) == last_finite(expected["test_acc"])
    assert fa.total_traffic_mb(run) == pytest.approx(
        (np.nansum(expected["fl_bytes_down"]) + np.nansum(expected["fl_bytes_up"])) / 1e6)
    assert math.isfinite(fa.kappa(run)) and math.isfinite(fa.rho(run))
    assert len(fa.rounds_table(runs)["round"]) == run.n_rounds
    assert len(fa.clients_table(runs)["client"]) == len(run.clients["client"]) > 0
    assert len(fa.group_table(runs, targets=[0.05])) == 1
    assert "completed" in summarize(path)
    for fmt in ("text", "csv", "markdown"):
        assert run.get("algorithm.name") in report_table(runs, fmt=fmt, at=[1], targets=[0.05])
    pytest.importorskip("matplotlib")
    out = fa.save_plot(runs, tmp_path / "archived.png", x="traffic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_window_accuracy_is_the_raw_mean_over_the_window(tmp_path):
    """Rounds 1..20 evaluated on even rounds at r / 100: the window 10..20 holds rounds
    10, 12, ..., 20, mean 0.15; 11..11 holds nothing; 15..30 is not reached."""
    acc = [NAN if r % 2 else r / 100 for r in range(1, 21)]
    run = fa.load(write_run(tmp_path / "curve.h5", acc))[0]
    assert fa.window_accuracy(run, 10, 20) == pytest.approx(0.15)
    assert fa.window_accuracy(run, 1, 4) == pytest.approx(0.03)
    assert math.isnan(fa.window_accuracy(run, 11, 11))
    assert math.isnan(fa.window_accuracy(run, 15, 30))
    # the EMA of the same curve lags: its value at 20 is below the window's last raw point
    assert fa.final_accuracy(run, smooth=0.9) < 0.20


def test_final_norm_is_the_final_models_norm(tiny, tmp_path):
    for path in tiny:
        with h5py.File(path, "r") as f:
            expected = float(np.linalg.norm(f["model"]["final"][()].astype(np.float64)))
        assert fa.final_norm(fa.load(path)[0]) == pytest.approx(expected, rel=1e-12) and expected > 0
    assert math.isnan(fa.final_norm(fa.load(write_run(tmp_path / "none.h5", [0.5, 0.6]))[0]))
    assert math.isnan(fa.final_norm(raw_rounds(tiny[0])))   # a plain dict of rounds has no model


def test_a_file_from_before_the_decay_parameter_reads_as_it_ran(tmp_path):
    """FedCM files record no algorithm.decay before it existed; they ran FL-Simulator's
    placement, and the analysis reads them so (a new file keeps what it records)."""
    old = write_run(tmp_path / "old.h5", [0.5], config={"algorithm": {"name": "fedcm", "alpha": 0.1},
                                                        "seed": 0, "rounds": 1})
    new = write_run(tmp_path / "new.h5", [0.5], config={"algorithm": {"name": "fedcm", "alpha": 0.1,
                                                                      "decay": "matched"},
                                                        "seed": 1, "rounds": 1})
    avg = write_run(tmp_path / "avg.h5", [0.5])
    runs = {run.path.name: run for run in fa.load(tmp_path)}
    assert runs["old.h5"].get("algorithm.decay") == "code"
    assert runs["new.h5"].get("algorithm.decay") == "matched"
    assert runs["avg.h5"].get("algorithm.decay") is None
    assert "algorithm.decay" in fa.differing_keys([runs["old.h5"], runs["new.h5"]])
    assert new and avg
