"""Single-process runs of the real runtime on small configs: file contents, exact FL
traffic, determinism, divergence."""

import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from helpers import TINY, merged


def run_tiny(tmp_path, name="run", base=TINY, **over):
    values = merged(base, **over)
    values["output"] = str(tmp_path / f"{name}.h5")
    c = cfg.from_dict(values)
    exp = run_experiment(c, LocalComm(), quiet=True)
    return c, exp, RunFile(c.output_path())


def test_fedavg_file_has_every_part_and_exact_fl_traffic(tmp_path):
    c, exp, run = run_tiny(tmp_path)
    with run:
        assert run.status == "completed"
        assert run.config["algorithm"]["name"] == "fedavg"
        rounds = run.rounds()
        assert rounds["round"].tolist() == [0, 1, 2, 3]   # 0: the initial model (eval.at_start)
        d = exp.d
        per_round = c.clients.per_round * d * 4
        assert rounds["fl_bytes_down"].tolist() == [0] + [per_round] * 3
        assert rounds["fl_bytes_up"].tolist() == [0] + [per_round] * 3
        assert (rounds["fl_bytes_down"] + rounds["fl_bytes_up"]).sum() == c.rounds * c.clients.per_round * 2 * d * 4
        assert rounds["mpi_bytes"].tolist() == [0, 0, 0, 0]  # one process moves nothing
        assert rounds["n_participants"].tolist() == [0, 5, 5, 5]
        assert run.ranks()["round"].tolist() == [0, 1, 2, 3] and run.ranks()["rank"].tolist() == [0] * 4
        assert run.ranks()["seconds_compute"][0] == 0 and np.all(run.ranks()["seconds_compute"][1:] > 0)
        assert np.all(np.isfinite(rounds["test_acc"])) and np.all(rounds["time_wall"] > 0)
        assert rounds["time_eval"][0] > 0 and rounds["time_compute"][0] == rounds["time_aggregate"][0] == 0
        for name in ("lr", "train_loss", "update_norm", "client_update_norm_mean"):
            assert np.isnan(rounds[name][0]) and not np.isnan(rounds[name][1:]).all(), name
        clients = run.clients()
        assert len(clients["client"]) == c.rounds * c.clients.per_round
        assert clients["round"].min() == 1
        assert np.all(clients["bytes_down"] == d * 4)
        part = run.partition()
        assert part["client_sizes"].sum() == 600
        assert part["class_counts"].sum() == 600
        assert run.model().shape == (d,)
        assert set(run.state_dict()) == {n for n, _, _ in exp.flat.layout_rows()}


def test_fedavg_moves_the_model_and_learns(tmp_path):
    c, exp, run = run_tiny(tmp_path, base=dict(TINY, partition={"kind": "iid"}), rounds=8,
                           clients={"num": 4, "per_round": 4}, train={"lr": 0.1},
                           model={"hidden": 64, "channels": [8, 16]})
    with run:
        acc = run.rounds()["test_acc"]
        assert acc[0] < 0.2 and acc[-1] > 0.4  # round 0, the initial model: chance is 0.1
        assert np.all(run.rounds()["update_norm"][1:] > 0)


def test_round_zero_is_the_initial_model_evaluated_independently(tmp_path):
    """The model built from the seed, scored on the test set by hand, gives round 0."""
    import torch
    import torch.nn.functional as F

    from fedmpi.data import load_dataset
    from fedmpi.data.augment import to_float
    from fedmpi.models import build_model
    from fedmpi.runtime.rng import key_seed

    c, _, run = run_tiny(tmp_path, rounds=1)
    with run:
        rounds = run.rounds()
    ds = load_dataset(c.data.dataset, seed=c.seed, **c.data.options)
    torch.manual_seed(key_seed(c.seed, "init"))
    model = build_model(c.model.name, ds.in_channels, ds.num_classes, ds.image_size,
                        **c.model.options).eval()
    with torch.no_grad():
        logits = model(to_float(ds.test_x, ds.mean, ds.std))
    assert rounds["round"].tolist() == [0, 1]
    assert rounds["test_acc"][0] == (logits.argmax(1) == ds.test_y).double().mean().item()
    assert rounds["test_loss"][0] == pytest.approx(F.cross_entropy(logits, ds.test_y).item(), rel=1e-5)


def test_at_start_false_starts_at_round_one_and_trains_the_same_bits(tmp_path):
    _, _, with0 = run_tiny(tmp_path, "with0", system={"deterministic": True})
    _, _, without = run_tiny(tmp_path, "without", eval={"at_start": False},
                             system={"deterministic": True})
    with with0, without:
        a, b = with0.rounds(), without.rounds()
        assert b["round"].tolist() == [1, 2, 3] and without.ranks()["round"].tolist() == [1, 2, 3]
        for name in ("train_loss", "test_acc", "test_loss", "update_norm"):
            assert np.array_equal(a[name][1:], b[name]), name
        assert np.array_equal(with0.model(), without.model())


def test_deterministic_single_process_equals_fast_single_process(tmp_path):
    _, _, fast = run_tiny(tmp_path, "fast", system={"threads": 1})
    _, _, det = run_tiny(tmp_path, "det", system={"deterministic": True})
    with fast, det:
        assert np.array_equal(fast.model(), det.model())
        assert np.array_equal(fast.rounds()["test_acc"], det.rounds()["test_acc"])


def test_same_seed_same_bits_other_seed_other_result(tmp_path):
    _, _, a = run_tiny(tmp_path, "a", system={"deterministic": True})
    _, _, b = run_tiny(tmp_path, "b", system={"deterministic": True})
    _, _, other = run_tiny(tmp_path, "c", seed=4, system={"deterministic": True})
    with a, b, other:
        assert np.array_equal(a.model(), b.model())
        assert not np.array_equal(a.model(), other.model())


def test_fedprox_with_mu_zero_is_fedavg(tmp_path):
    _, _, avg = run_tiny(tmp_path, "avg", system={"deterministic": True})
    _, _, prox = run_tiny(tmp_path, "prox", algorithm={"name": "fedprox", "mu": 0.0},
                          system={"deterministic": True})
    _, _, prox1 = run_tiny(tmp_path, "prox1", algorithm={"name": "fedprox", "mu": 1.0},
                           system={"deterministic": True})
    with avg, prox, prox1:
        assert np.array_equal(avg.model(), prox.model())
        assert not np.array_equal(avg.model(), prox1.model())


def test_divergence_stops_and_marks_the_file(tmp_path):
    c, exp, run = run_tiny(tmp_path, train={"lr": 1e6, "grad_clip": 0.0})
    with run:
        assert exp.diverged
        assert run.status == "failed"
        assert len(run.rounds()["round"]) >= 1
        assert "diverged" in run.attrs["error"]


def test_existing_file_is_refused_without_force(tmp_path):
    c, _, run = run_tiny(tmp_path)
    run.close()
    before = c.output_path().read_bytes()
    from fedmpi.errors import UsageError
    with pytest.raises(UsageError, match="--force"):
        run_experiment(c, LocalComm(), quiet=True)
    assert c.output_path().read_bytes() == before


@pytest.mark.slow
def test_resnet18_gn_on_the_cifar_pickle_fixture_with_augmentation(tmp_path):
    from conftest import ROOT

    base = dict(TINY, data={"dataset": "cifar10", "data_dir": str(ROOT / "tests/data"),
                            "augment": True},
                partition={"kind": "iid"}, model={"name": "resnet18", "stem": "cifar"})
    c, exp, run = run_tiny(tmp_path, base=base, rounds=1, clients={"num": 4, "per_round": 2},
                           train={"batch_size": 8}, eval={"at_start": False})
    with run:
        assert run.status == "completed" and exp.d == 11_173_962
        assert run.partition()["client_sizes"].sum() == 40
        assert run.rounds()["fl_bytes_up"][0] == 2 * exp.d * 4
        assert run.state_dict()["stem.0.weight"].shape == (64, 3, 3, 3)


def test_update_statistics_land_in_the_file(tmp_path):
    _, _, plain = run_tiny(tmp_path, "plain", system={"deterministic": True})
    c, exp, run = run_tiny(tmp_path, "stats", eval={"update_stats": True},
                           system={"deterministic": True})
    with run, plain:
        rounds = {k: v[1:] for k, v in run.rounds().items()}   # round 0 trains nothing: NaN
        assert np.isnan(run.rounds()["local_consistency"][0])
        assert np.all((rounds["client_update_cosine_mean"] >= -1) & (rounds["client_update_cosine_mean"] <= 1))
        assert np.all(rounds["local_consistency"] >= 0)
        norms = run.clients()["update_norm"].reshape(c.rounds, -1)
        np.testing.assert_allclose(rounds["client_update_norm_mean"], norms.mean(axis=1))
        assert np.isnan(plain.rounds()["client_update_cosine_mean"]).all()
        assert np.array_equal(run.model(), plain.model())  # statistics never change training


def test_observers_are_called_at_their_named_points(tmp_path):
    from fedmpi.runtime.experiment import Experiment
    from fedmpi.runtime.observers import Observer, default_observers

    class Recorder(Observer):
        def __init__(self):
            self.calls = []

        def on_setup(self, exp):
            self.calls.append("setup")

        def before_round(self, exp, t):
            self.calls.append(f"before {t}")

        def after_evaluate(self, exp, t, timers):
            self.calls.append(f"evaluated {t}")

        def after_round(self, exp, record):
            self.calls.append(f"round {record.round} {record.ranks['seconds_compute'][0] > 0}")

    values = merged(TINY, rounds=2)
    values["output"] = str(tmp_path / "observed.h5")
    recorder = Recorder()
    exp = Experiment(cfg.from_dict(values), LocalComm(), quiet=True,
                     observers=default_observers(quiet=True) + [recorder])
    exp.run()
    assert recorder.calls == ["setup", "round 0 False", "before 0", "evaluated 0", "round 1 True",
                              "before 1", "evaluated 1", "round 2 True"]
