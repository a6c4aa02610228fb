"""What a table's rows differ in besides their labels, and replicas of one seed.

`fedmpi report` and tools/paper_table.py name the config keys the compared runs also
differ in (`also differ: ...`), and say where a group's ± is a spread of replicas (runs
sharing a seed) rather than over seeds. Real `fedmpi run`s of TINY (2 rounds), made
once for the module: each test picks the files it compares.
"""

import csv
import io

import pytest
from conftest import fedmpi
from helpers import write_config
from test_analysis import run_cli
from test_report_tables import tool

from fedmpi import analysis as fa

REPLICAS = "± is the spread of replicas, not over seeds"

# name: (algorithm, seed, other --set values); every run has system.threads=1 unless set
RUNS = {
    "avgm1": ("fedavgm", 1, []),
    "avgm1_threads": ("fedavgm", 1, ["system.threads=2"]),          # a replica of avgm1
    "avgm2_wd": ("fedavgm", 2, ["train.weight_decay=0.001"]),
    "acg1": ("fedacg", 1, []),                                        # beta 0.01; fedavgm's is 0.9
    "acg2_wd": ("fedacg", 2, ["train.weight_decay=0.001"]),
    "avgm2_tf32": ("fedavgm", 2, ["system.precision=tf32"]),
    "avgm2_beta": ("fedavgm", 2, ["algorithm.beta=0.5"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: results file} of RUNS."""
    directory = tmp_path_factory.mktemp("confounds")
    config = write_config(directory / "tiny.toml", rounds=2, eval={"every": 1, "batch_size": 64})
    out = {}
    for name, (algorithm, seed, sets) in RUNS.items():
        out[name] = directory / f"{name}.h5"
        values = [f"algorithm.name={algorithm}", f"seed={seed}", "system.threads=1", *sets]
        fedmpi(["run", config, "-q", "-o", out[name], *[a for v in values for a in ("--set", v)]],
               timeout=300, check=True)
    return out


def report(runs, names, *args):
    proc = run_cli(["report", *(runs[n] for n in names), *args])
    assert proc.returncode == 0, proc.stderr
    return proc


def also_differ(text):
    return [line for line in text.splitlines() if line.startswith("also differ")]


def cell(line, column):
    return [c.strip() for c in line.split("  ") if c.strip()][column]


@pytest.mark.slow
def test_a_field_nobody_grouped_by_is_named_under_the_table(runs):
    """weight_decay differs within both algorithms; the algorithms' beta differs only
    between them (two parameters that share a name), lr and the rest not at all."""
    four = ["avgm1", "avgm2_wd", "acg1", "acg2_wd"]
    for fmt in ("text", "markdown"):
        out = report(runs, four, "-g", "algorithm.name", "--columns", "final", "--format", fmt).stdout
        assert also_differ(out) == ["also differ: train.weight_decay"], out
    grouped = report(runs, four, "-g", "algorithm.name", "-g", "train.weight_decay", "--columns", "final")
    assert also_differ(grouped.stdout) == []
    default = report(runs, four, "--columns", "final").stdout     # weight_decay is a column
    assert also_differ(default) == [] and "weight_decay" in default.splitlines()[0]


@pytest.mark.slow
def test_precision_is_named_with_the_default_grouping_and_threads_is_not(runs):
    out = report(runs, ["avgm1", "avgm1_threads", "avgm2_tf32"], "--columns", "final").stdout
    assert also_differ(out) == ["also differ: system.precision"], out
    assert "threads" not in out
    only_threads = report(runs, ["avgm1", "avgm1_threads"], "--columns", "final").stdout
    assert also_differ(only_threads) == [] and "threads" not in only_threads


@pytest.mark.slow
def test_one_algorithms_parameter_differing_is_named_anothers_is_not(runs):
    """fedavgm beta 0.9 against 0.5 is a confound; fedavgm's 0.9 against fedacg's 0.01
    is two algorithms' parameters that share a name."""
    out = report(runs, ["avgm1", "avgm2_beta", "acg1"], "-g", "algorithm.name", "--columns", "final").stdout
    assert also_differ(out) == ["also differ: algorithm.beta"]
    apart = report(runs, ["avgm1", "acg1"], "-g", "algorithm.name", "--columns", "final").stdout
    assert also_differ(apart) == []


@pytest.mark.slow
def test_csv_stays_a_table_and_the_line_goes_to_stderr(runs):
    proc = report(runs, ["avgm1", "avgm1_threads", "avgm2_wd"], "-g", "algorithm.name", "--format", "csv",
                  "--columns", "final")
    assert proc.stderr == "fedmpi report: also differ: train.weight_decay\n"
    assert "also differ" not in proc.stdout
    header = proc.stdout.splitlines()[0].split(",")
    assert header[:4] == ["algorithm.name", "status", "n", "seeds"]
    (row,) = csv.DictReader(io.StringIO(proc.stdout))
    assert (row["n"], row["seeds"]) == ("3", "2")
    clean = report(runs, ["avgm1", "avgm1_threads"], "--format", "csv", "--columns", "final")
    assert clean.stderr == ""


@pytest.mark.slow
def test_replicas_of_one_seed_are_not_called_a_spread_over_seeds(runs):
    for fmt, sep in (("text", "  "), ("markdown", " | ")):
        out = report(runs, ["avgm1", "avgm1_threads"], "--columns", "final", "--format", fmt).stdout
        assert f"{sep}2 (1 seed){sep}" in out.splitlines()[2]
        assert f"fedavgm: 2 runs, 1 distinct seed: {REPLICAS}" in out.splitlines()
    three = report(runs, ["avgm1", "avgm1_threads", "avgm2_tf32"], "--columns", "final").stdout
    assert cell(three.splitlines()[2], 1) == "3 (2 seeds)"
    assert f"fedavgm: 3 runs, 2 distinct seeds: {REPLICAS}" in three.splitlines()
    distinct = report(runs, ["avgm1", "avgm2_wd", "acg1", "acg2_wd"], "-g", "algorithm.name",
                      "--columns", "final").stdout
    assert [cell(line, 1) for line in distinct.splitlines()[2:4]] == ["2", "2"]
    assert "seed" not in distinct and "replicas" not in distinct
    assert "mean ± std (sample std) over the n runs of a group" in distinct


@pytest.mark.slow
def test_paper_table_says_over_seeds_only_where_every_cell_has_distinct_seeds(runs):
    distinct = tool("paper_table.py", *(runs[n] for n in ("avgm1", "avgm2_wd", "acg1", "acg2_wd")),
                    "--setting", "partition.alpha")
    assert distinct.returncode == 0, distinct.stderr
    lines = distinct.stdout.splitlines()
    assert lines[-2:] == ["also differ: train.weight_decay", "mean ± std over seeds; accuracy in %"]
    replicas = tool("paper_table.py", *(runs[n] for n in ("avgm1", "avgm1_threads", "acg1")),
                    "--setting", "partition.alpha")
    assert replicas.returncode == 0, replicas.stderr
    lines = replicas.stdout.splitlines()
    assert lines[-2:] == ["mean ± std over the runs of a cell; accuracy in %",
                          f"fedavgm, alpha=0.5: 2 runs, 1 distinct seed: {REPLICAS}"]
    assert "over seeds;" not in replicas.stdout


@pytest.mark.slow
def test_paper_table_csv_has_seeds_after_n_and_the_line_on_stderr(runs):
    proc = tool("paper_table.py", *(runs[n] for n in ("avgm1", "avgm1_threads", "avgm2_wd", "acg1")),
                "--setting", "partition.alpha", "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "paper_table: also differ: train.weight_decay\n"
    header = proc.stdout.splitlines()[0].split(",")
    assert header[1:3] == ["alpha=0.5 n", "alpha=0.5 seeds"]
    rows = {row["algorithm.name"]: row for row in csv.DictReader(io.StringIO(proc.stdout))}
    assert (rows["fedavgm"]["alpha=0.5 n"], rows["fedavgm"]["alpha=0.5 seeds"]) == ("3", "2")
    assert (rows["fedacg"]["alpha=0.5 n"], rows["fedacg"]["alpha=0.5 seeds"]) == ("1", "1")


@pytest.mark.slow
def test_the_api_names_confounds_and_counts_distinct_seeds(runs):
    def load(*names):
        return fa.load([runs[n] for n in names])

    four = load("avgm1", "avgm2_wd", "acg1", "acg2_wd")
    assert fa.confounds(four, ["algorithm.name"]) == ["train.weight_decay"]
    assert fa.confounds(four, "algorithm.name") == ["train.weight_decay"]
    assert fa.confounds(four, ["algorithm.name", "train.weight_decay"]) == []
    assert fa.confounds(four, []) == ["algorithm.name", "train.weight_decay"]
    assert fa.confounds(load("avgm1", "avgm2_beta", "acg1"), ["algorithm.name"]) == ["algorithm.beta"]
    assert fa.confounds(load("avgm1", "acg1"), ["algorithm.name"]) == []
    mixed = load("avgm1", "avgm1_threads", "avgm2_tf32")
    assert fa.confounds(mixed, fa.group_keys(mixed)) == ["system.precision"]
    assert fa.confounds(mixed, ["seed", "rounds"]) == ["system.precision"]   # prefix-less keys

    (row,) = fa.group_table(mixed, ["algorithm.name"])
    assert list(row)[:4] == ["algorithm.name", "status", "n", "seeds"] and (row["n"], row["seeds"]) == (3, 2)
    for run in mixed:          # files that record no seed: each run counts as a seed of its own
        del run.config["seed"]
    (row,) = fa.group_table(mixed, ["algorithm.name"])
    assert (row["n"], row["seeds"]) == (3, 3)
