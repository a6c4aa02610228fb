"""`fedmpi report` tables (text, CSV, Markdown) and the tools/ scripts, run as commands.

Group means and stds are computed here from the raw HDF5 datasets with h5py, numpy and
statistics, independently of fedmpi.analysis.
"""

import csv
import io
import statistics
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from test_analysis import last_finite, make_tiny_runs, raw_rounds, run_cli, write_run

from fedmpi.analysis.report import summarize

TOOLS = Path(__file__).resolve().parents[1] / "tools"
NAN = float("nan")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_runs(tmp_path_factory.mktemp("report"))


def by_algorithm(paths):
    """{algorithm: [raw rounds of each seed]} straight from the files."""
    out = {}
    for path in paths:
        out.setdefault(path.name.split("-")[0], []).append(raw_rounds(path))
    return out


def pct(mean, std):
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


@pytest.mark.slow
def test_text_table_groups_seeds_by_algorithm(tiny):
    proc = run_cli(["report", tiny[0].parent])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["algorithm", "n", "final", "%", "best", "%", "traffic", "MB", "time", "s",
                                "kappa", "rho"]
    assert set(lines[1]) <= {"-", " "}
    for algorithm, seeds in by_algorithm(tiny).items():
        row = next(line for line in lines if line.split()[0] == algorithm)
        finals = [last_finite(r["test_acc"]) for r in seeds]
        bests = [max(a for a in r["test_acc"] if a == a) for r in seeds]
        assert row.split()[1] == "2"
        assert pct(statistics.mean(finals), statistics.stdev(finals)) in row
        assert pct(statistics.mean(bests), statistics.stdev(bests)) in row
    assert "mean ± std (sample std) over the n runs of a group" in proc.stdout


def test_csv_has_raw_means_stds_and_reached_counts(tiny):
    # options given twice (0.05 and 5% are one target) are one column: csv names stay unique
    proc = run_cli(["report", *tiny, "--format", "csv", "--at", "2", "--target", "0.05",
                    "--target", "99%", "--at", "2", "--target", "5%"])
    assert proc.returncode == 0, proc.stderr
    assert "±" not in proc.stdout
    header = proc.stdout.splitlines()[0].split(",")
    assert len(header) == len(set(header)) and header.count("acc@2_mean") == 1
    rows = {row["algorithm.name"]: row for row in csv.DictReader(io.StringIO(proc.stdout))}
    assert list(rows) == ["fedavg", "fedavgm"]
    with h5py.File(tiny[0], "r") as f:
        d = int(f.attrs["num_params"])
    for algorithm, seeds in by_algorithm(tiny).items():
        row = rows[algorithm]
        finals = [last_finite(r["test_acc"]) for r in seeds]
        times = [float(sum(r["time_wall"])) for r in seeds]
        assert row["status"] == "completed" and row["n"] == "2"
        assert float(row["final_acc_mean"]) == pytest.approx(statistics.mean(finals))
        assert float(row["final_acc_std"]) == pytest.approx(statistics.stdev(finals))
        at2 = [r["test_acc"][r["round"] == 2][0] for r in seeds]   # rows: rounds 0 (initial) .. 4
        assert float(row["acc@2_mean"]) == pytest.approx(statistics.mean(at2))
        firsts = [next(int(i) for i, a in zip(r["round"], r["test_acc"]) if a >= 0.05) for r in seeds]
        assert row["rounds_to_0.05_reached"] == "2"
        assert float(row["rounds_to_0.05_mean"]) == statistics.mean(firsts)
        assert row["rounds_to_0.99_reached"] == "0" and row["rounds_to_0.99_mean"] == ""
        assert float(row["traffic_mb_mean"]) == pytest.approx(4 * 5 * 2 * d * 4 / 1e6)
        assert float(row["time_s_mean"]) == pytest.approx(statistics.mean(times))
        kappas = [a * 1e4 / t for a, t in zip(finals, times)]
        assert float(row["kappa_mean"]) == pytest.approx(statistics.mean(kappas))
        assert float(row["kappa_std"]) == pytest.approx(statistics.stdev(kappas))


def test_markdown_table_with_chosen_columns(tiny):
    proc = run_cli(["report", tiny[0].parent, "--format", "markdown", "--columns", "final,best"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "| algorithm | n | final % | best % |"
    assert lines[1] == "| --- | ---: | ---: | ---: |"
    seeds = by_algorithm(tiny)["fedavg"]
    finals = [last_finite(r["test_acc"]) for r in seeds]
    assert lines[2].startswith(f"| fedavg | 2 | {pct(statistics.mean(finals), statistics.stdev(finals))} | ")


def test_one_file_without_options_is_the_run_summary(tiny):
    proc = run_cli(["report", tiny[0]])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == summarize(tiny[0]) + "\n"
    table = run_cli(["report", tiny[0], "--format", "text"]).stdout
    assert table.splitlines()[0].startswith("algorithm  n")


@pytest.fixture
def sweep(tmp_path):
    """2 algorithms x alpha 0.1/0.5 x 3 seeds; final acc = base + 0.01 * seed, evaluated
    every round; reaching 0.8 at round 3 + seed ... except seed 2 of fedavg never does."""
    base = {("fedavg", 0.1): 0.70, ("fedavg", 0.5): 0.75, ("fedacg", 0.1): 0.80, ("fedacg", 0.5): 0.85}
    for (algorithm, alpha), acc in base.items():
        for seed in range(3):
            final = acc + 0.01 * seed
            curve = [0.5, 0.6, 0.7, final, final] if algorithm == "fedavg" else [0.5, 0.7, 0.9, final, final]
            if algorithm == "fedavg" and seed < 2:
                curve[seed + 2] = 0.81  # reaches 0.8 at round 3 (seed 0) or 4 (seed 1)
            config = {"algorithm": {"name": algorithm}, "partition": {"kind": "dirichlet", "alpha": alpha},
                      "seed": seed, "rounds": 5, "output": f"{algorithm}-{alpha}-{seed}.h5"}
            write_run(tmp_path / "sweep" / f"{algorithm}-a{alpha}-s{seed}.h5", curve, config)
    return tmp_path / "sweep"


def test_groups_by_the_differing_keys_and_counts_runs_that_reached(sweep):
    proc = run_cli(["report", sweep, "--target", "0.8", "--columns", "final,rounds"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["algorithm", "alpha", "n", "final", "%", "R@80%"]
    rows = [line.split("  ") for line in lines[2:6]]
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    assert cells == [
        ["fedacg", "0.1", "3", pct(0.81, 0.01), "3 ± 0.0 (3/3)"],
        ["fedacg", "0.5", "3", pct(0.86, 0.01), "3 ± 0.0 (3/3)"],
        ["fedavg", "0.1", "3", pct(0.71, 0.01), "3.5 ± 0.7 (2/3)"],
        ["fedavg", "0.5", "3", pct(0.76, 0.01), "3.5 ± 0.7 (2/3)"],
    ]
    by_alpha = run_cli(["report", sweep, "-g", "partition.alpha", "--columns", "final"]).stdout.splitlines()
    # two algorithms x seeds 0-2 in a group: 6 runs of 3 seeds, and the algorithm not a column
    assert [line.split()[:5] for line in by_alpha[2:4]] == [["0.1", "6", "(3", "seeds)", "76.00"],
                                                            ["0.5", "6", "(3", "seeds)", "81.00"]]
    assert "also differ: algorithm.name" in by_alpha


def test_smoothed_accuracy_is_used_when_asked(sweep):
    plain = run_cli(["report", sweep, "--format", "csv", "--columns", "final"]).stdout
    smooth = run_cli(["report", sweep, "--format", "csv", "--columns", "final", "--smooth", "0.9"]).stdout
    first = next(csv.DictReader(io.StringIO(smooth)))
    levels = []
    for seed in range(3):  # fedacg, alpha 0.1
        curve = [0.5, 0.7, 0.9, 0.80 + 0.01 * seed, 0.80 + 0.01 * seed]
        level = curve[0]
        for a in curve[1:]:
            level = 0.9 * level + 0.1 * a
        levels.append(level)
    assert first["algorithm.name"] == "fedacg" and first["n"] == "3"
    assert float(first["final_acc_mean"]) == pytest.approx(statistics.mean(levels))
    assert float(first["final_acc_std"]) == pytest.approx(statistics.stdev(levels))
    assert plain != smooth


def test_runs_that_did_not_complete_get_their_own_rows(tmp_path):
    config = {"algorithm": {"name": "fedavg"}, "seed": 0, "rounds": 3}
    write_run(tmp_path / "a.h5", [0.1, 0.2, 0.3], config)
    write_run(tmp_path / "b.h5", [0.1, 0.2, 0.3], {**config, "seed": 1})
    write_run(tmp_path / "c.h5", [0.1], {**config, "seed": 2}, status="failed", failed_round=2,
              error="loss is NaN")
    out = run_cli(["report", tmp_path, "--columns", "final"]).stdout.splitlines()
    assert out[0].split() == ["algorithm", "status", "n", "final", "%"]
    assert [line.split()[:4] for line in out[2:4]] == [["fedavg", "completed", "2", "30.00"],
                                                        ["fedavg", "failed", "1", "10.00"]]
    assert "runs that did not complete are grouped apart" in "\n".join(out)
    only = run_cli(["report", tmp_path, "--completed-only", "--columns", "final"]).stdout.splitlines()
    assert "status" not in only[0] and len([line for line in only if line.startswith("fedavg")]) == 1


@pytest.mark.parametrize("args, names", [
    (["-g", "partiton.alpha"], "partition.alpha"),
    (["--target", "80"], "--target '80'"),
    (["--at", "0"], "--at '0'"),
    (["--format", "html"], "--format 'html'"),
    (["--columns", "final,speed"], "'speed'"),
    (["--columns", "rounds"], "--target"),
    (["--smooth", "1.5"], "--smooth"),
    (["--window", "100:60"], "--window '100:60'"),
    (["--window", "0:10"], "--window '0:10'"),
    (["--window", "sixty"], "--window 'sixty'"),
    (["--columns", "window"], "--window START:END"),
])
def test_bad_options_are_one_line_and_exit_2(sweep, args, names):
    proc = run_cli(["report", sweep, *args])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("fedmpi: ") and names in proc.stderr


def test_bad_files_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "notes.h5").write_text("hello")
    for path, says in ((tmp_path / "missing.h5", "does not exist"),
                       (tmp_path / "notes.h5", "not an HDF5 file"),
                       (tmp_path / "empty", "no fedmpi results files")):
        if path.name == "empty":
            path.mkdir()
        proc = run_cli(["report", path])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr


def tool(name, *args):
    return subprocess.run([sys.executable, str(TOOLS / name), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_paper_table_lays_out_methods_by_settings(sweep):
    proc = tool("paper_table.py", sweep, "--target", "0.8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split("  ")[0] == "algorithm"
    assert [h.strip() for h in lines[0].split("  ") if h.strip()] == \
        ["algorithm", "alpha=0.1 acc", "alpha=0.1 R@80%", "alpha=0.5 acc", "alpha=0.5 R@80%"]
    assert [c.strip() for c in lines[2].split("  ") if c.strip()] == \
        ["fedacg", pct(0.81, 0.01), "3 ± 0.0 (3/3)", pct(0.86, 0.01), "3 ± 0.0 (3/3)"]
    assert lines[3].startswith("fedavg") and "3.5 ± 0.7 (2/3)" in lines[3]
    md = tool("paper_table.py", sweep, "--format", "markdown", "--at", "2").stdout.splitlines()
    assert md[0] == "| algorithm | alpha=0.1 acc@2 | alpha=0.5 acc@2 |"
    assert md[2] == f"| fedacg | {pct(0.7, 0)} | {pct(0.7, 0)} |"
    rows = list(csv.DictReader(io.StringIO(tool("paper_table.py", sweep, "--format", "csv").stdout)))
    assert [r["algorithm.name"] for r in rows] == ["fedacg", "fedavg"]
    assert float(rows[1]["alpha=0.5 final_acc_mean"]) == pytest.approx(0.76) and rows[1]["alpha=0.5 n"] == "3"
    bad = tool("paper_table.py", sweep, "--setting", "partition.beta")
    assert bad.returncode == 2 and bad.stderr.startswith("fedmpi: --setting")


def test_merge_runs_writes_one_row_per_run(sweep, tmp_path):
    out = tmp_path / "all.csv"
    proc = tool("merge_runs.py", sweep, "-o", out, "--target", "0.8")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 12
    first = rows[0]
    assert first["run"].endswith("fedacg-a0.1-s0.h5") and first["status"] == "completed"
    assert (first["partition.alpha"], first["partition.kind"], first["seed"]) == ("0.1", "dirichlet", "0")
    assert float(first["final_acc"]) == pytest.approx(0.80) and first["rounds_to_0.8"] == "3"
    assert float(first["traffic_mb"]) == pytest.approx(10.0) and float(first["time_s"]) == pytest.approx(10.0)
    never = next(r for r in rows if r["run"].endswith("fedavg-a0.1-s2.h5"))
    assert never["rounds_to_0.8"] == ""
    assert tool("merge_runs.py", sweep, "--target", "80%").stdout == out.read_text()


@pytest.mark.slow
def test_window_means_and_the_final_norm_per_group(tiny):
    """--window 2:4 is the mean of the raw accuracy at rounds 2 and 4 (eval.every = 2);
    --columns norm the L2 norm of each run's final model, both as mean ± std over seeds,
    computed here from the raw files."""
    import numpy as np

    proc = run_cli(["report", tiny[0].parent, "--window", "2:4", "--columns", "window,norm",
                    "--format", "csv"])
    assert proc.returncode == 0, proc.stderr
    rows = {row["algorithm.name"]: row for row in csv.DictReader(io.StringIO(proc.stdout))}
    for algorithm in by_algorithm(tiny):
        paths = [p for p in tiny if p.name.startswith(algorithm + "-")]
        windows = [(raw_rounds(p)["test_acc"][2] + raw_rounds(p)["test_acc"][4]) / 2 for p in paths]
        norms = []
        for path in paths:
            with h5py.File(path, "r") as f:
                norms.append(float(np.linalg.norm(f["model"]["final"][()].astype(np.float64))))
        row = rows[algorithm]
        assert float(row["window@2-4_mean"]) == pytest.approx(statistics.mean(windows), rel=1e-12)
        assert float(row["window@2-4_std"]) == pytest.approx(statistics.stdev(windows), rel=1e-9)
        assert float(row["final_norm_mean"]) == pytest.approx(statistics.mean(norms), rel=1e-12)
    text = run_cli(["report", tiny[0].parent, "--window", "2:4", "--columns", "window,final,norm"]).stdout
    assert text.splitlines()[0].split() == ["algorithm", "n", "acc[2-4]", "%", "final", "%", "‖x‖"]
    assert "acc[a-b]: the mean of the raw (never smoothed) test accuracy" in text
    # without --columns norm no file's model is read, and no norm column appears
    assert "‖x‖" not in run_cli(["report", tiny[0].parent, "--window", "2:4"]).stdout
