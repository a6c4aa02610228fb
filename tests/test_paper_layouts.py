"""The seed papers' table layouts (tools/paper_table.py --paper, fedmpi.analysis.papers):
the paper's numbers as printed, every method the main tables name mapped to a fedmpi
configuration, and real runs in a paper's setting shown beside the paper's numbers."""

import csv
import io
import itertools

import pytest
from conftest import ROOT, fedmpi
from helpers import SSL, write_config
from test_report_tables import tool

from fedmpi.algorithms import REGISTRY
from fedmpi.analysis import papers
from fedmpi.analysis.paper_numbers import BLOCKS


def test_blocks_hold_the_papers_numbers_as_printed():
    """Spot checks against the papers' tables, one per table, corners and middles."""
    def value(paper, source, method, metric):
        block = next(b for b in BLOCKS if b.paper == paper and b.source == source)
        return block.rows[method][block.metrics.index(metric)]

    assert value("fedacg", "Table 1a, CIFAR-10", "FedDC", "acc@500") == 86.52
    assert value("fedacg", "Table 1a, CIFAR-10", "FedACG", "rounds_to_0.85") == 450
    assert value("fedacg", "Table 1a, Tiny-ImageNet", "FedDecorr", "rounds_to_0.35") == "1000+"
    assert value("fedacg", "Table 1b, CIFAR-100", "FedMLB", "acc@1000") == 42.61
    assert value("fedacg", "Table 1b, Tiny-ImageNet", "FedACG", "rounds_to_0.3") == 447
    assert value("fedmrur", "Table 2, Tiny-ImageNet", "FedMRUR", "final_acc") in (45.54, 45.41, 45.42, 45.71)
    assert value("fedmim", "Table 1, CIFAR-10", "FedMIM", "final_acc") in (86.39, 84.39, 80.82)
    assert value("fedu2", "Table 1, CIFAR-100, K = 10", "FedU2-BYOL", "finetune_10pct_acc") == 53.87
    assert value("fedu2", "Table 1, CIFAR-10, K = 100", "FedSimsiam", "linear_acc") == 60.49
    assert value("fedu2", "Table 2, CIFAR-100, alpha = 5", "Orchestra", "final_acc") == 34.93
    assert value("fedu2", "Table 2, CIFAR-10, alpha = 0.1", "FedU2-FUR-BYOL", "final_acc") == 81.04
    # every block of a table has every row of it, one value per metric
    for paper, count in (("fedacg", 6), ("fedmrur", 8), ("fedmim", 9), ("fedu2", 10)):
        blocks = [b for b in BLOCKS if b.paper == paper]
        assert len(blocks) == count, paper
        assert all(len(v) == len(b.metrics) for b in blocks for v in b.rows.values())
    acg = [b for b in BLOCKS if b.paper == "fedacg"]
    assert {b.match["data.dataset"] for b in acg} == {"cifar10", "cifar100", "tiny_imagenet"}
    assert {(b.match["clients.num"], b.match["clients.per_round"]) for b in acg} == {(100, 5), (500, 10)}


def _configurations():
    """(algorithm.name, backbone, fur, aggregator) of every registered method: the
    backbones and ablation switches its Params take."""
    for name, cls in REGISTRY.items():
        fields = {f.name: f for f in cls.Params.__dataclass_fields__.values()}
        backbones = _choices(fields.get("backbone")) or [None]
        furs = _choices(fields.get("fur")) or [None]
        aggregators = _choices(fields.get("aggregator")) or [None]
        for backbone, fur, aggregator in itertools.product(backbones, furs, aggregators):
            yield {"algorithm.name": name, "algorithm.backbone": backbone, "algorithm.fur": fur,
                   "algorithm.aggregator": aggregator}


def _choices(f):
    allowed = f.metadata.get("allowed") if f is not None else None
    return list(allowed) if isinstance(allowed, tuple) else []


@pytest.mark.parametrize("paper", sorted({b.paper for b in BLOCKS}))
def test_every_method_of_the_papers_main_tables_is_a_fedmpi_configuration(paper):
    layout = papers.layout(paper)
    ours = {layout.label(values) for values in _configurations()}
    named = {method for b in BLOCKS if b.paper == paper for method in b.rows}
    assert named - ours == set()


def test_an_unknown_paper_is_one_line():
    proc = tool("paper_table.py", str(ROOT / "tests"), "--paper", "fedx2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fedmpi: --paper 'fedx2': allowed are fedacg, fedmrur, fedmim, fnrfl, fedu2"]


@pytest.fixture(scope="module")
def fedu2_setting(tmp_path_factory):
    """FedBYOL and FedSimCLR for one round in FedU^2's Table 2 setting (CIFAR-10, K = 10,
    Dir(0.1)) on the 40-image CIFAR-10 fixture, and one FedBYOL run off it (Dir(0.5) is
    a Table 2 column too, so: K = 5)."""
    directory = tmp_path_factory.mktemp("paper")
    base = {**SSL, "data": {"dataset": "cifar10", "data_dir": str(ROOT / "tests/data/cifar-10-batches-py")}}
    config = write_config(directory / "ssl.toml", base=base, rounds=1,
                          partition={"kind": "dirichlet", "alpha": 0.1},
                          clients={"num": 10, "per_round": 10}, eval={"every": 1})
    runs = {"byol": ["algorithm.name=fedbyol"], "simclr": ["algorithm.name=fedsimclr"],
            "byol_k5": ["algorithm.name=fedbyol", "clients.num=5", "clients.per_round=5"]}
    for name, sets in runs.items():
        fedmpi(["run", config, "-q", "-o", directory / f"{name}.h5",
                *[a for v in sets for a in ("--set", v)]], timeout=300, check=True)
    return directory


def test_runs_in_a_papers_setting_show_its_numbers_beside_ours(fedu2_setting):
    proc = tool("paper_table.py", fedu2_setting, "--paper", "fedu2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    header = lines[0]
    assert "num=10, per_round=10 acc" in header and "num=10, per_round=10 LP" in header and "per_round=5 acc" in header
    byol = next(line for line in lines if line.startswith("FedBYOL"))
    assert "[76.12]" in byol and "[83.29]" in byol and "[81.4]" in byol   # Table 2 kNN, Table 1 LP / FT 10%
    simclr = next(line for line in lines if line.startswith("FedSimCLR"))
    assert "[75.65]" in simclr and "[76.12]" not in simclr
    assert "dataset=cifar10, num=10, per_round=10: paper numbers from Table 1, CIFAR-10, K = 10, " \
           "Table 2, CIFAR-10, alpha = 0.1" in out
    assert "dataset=cifar10, num=5, per_round=5: the paper reports no number in this setting" in out
    rows = list(csv.DictReader(io.StringIO(
        tool("paper_table.py", fedu2_setting, "--paper", "fedu2", "--format", "csv").stdout)))
    byol_row = next(r for r in rows if r["method"] == "FedBYOL")
    assert byol_row["dataset=cifar10, num=10, per_round=10 final_acc_paper"] == "76.12"
    assert 0.0 <= float(byol_row["dataset=cifar10, num=10, per_round=10 final_acc_mean"]) <= 1.0


def test_two_configurations_one_paper_name_are_told_apart():
    layout = papers.layout("fedu2")
    grouped = [{"algorithm.name": "fedu2", "algorithm.backbone": "byol", "algorithm.fur": fur,
                "algorithm.aggregator": "eua"} for fur in ("paper", "code", "none")]
    keys = ["algorithm.name", "algorithm.backbone", "algorithm.fur", "algorithm.aggregator"]
    assert papers._labels(layout, grouped, keys) == [
        "FedU2-BYOL (fur=paper)", "FedU2-BYOL (fur=code)", "FedU2-FUR-BYOL"]


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "reproductions").glob("*.toml")),
                         ids=lambda p: p.stem)
def test_every_reproduction_sweep_resolves_every_cell(path):
    """A sweep file per paper: each cell a valid config (``sweep.load`` resolves them all)."""
    from fedmpi import sweep

    cells = sweep.load(path, outdir=str(ROOT / "runs")).cells
    assert cells and len({c.name for c in cells}) == len(cells)


def test_the_fedu2_sweep_runs_every_method_of_its_tables():
    """benchmarks/reproductions/fedu2.toml: every row of FedU^2's Tables 1-2, one setup."""
    from fedmpi import sweep

    cells = sweep.load(ROOT / "benchmarks/reproductions/fedu2.toml", outdir=str(ROOT / "runs")).cells
    layout = papers.layout("fedu2")
    labels = {layout.label({f"algorithm.{k}": v for k, v in dict(c.values)["algorithm"].items()})
              for c in cells}
    for algorithm in {tuple(sorted(dict(c.values)["algorithm"].items())) for c in cells}:
        params = dict(algorithm)
        assert params["proj_dim"] == 128 and params["proj_hidden"] == 512, params
    assert labels == {method for b in BLOCKS if b.paper == "fedu2" for method in b.rows}
    assert {dict(c.values)["seed"] for c in cells} == {0, 1, 2}
