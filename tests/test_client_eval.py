"""Local test splits (``partition.local_test``) and per-client evaluation (``eval.clients``,
``eval.client_finetune_epochs``; fedmpi.runtime.client_eval): the split's sizes and
stratification, every client's scores against the model scored directly, the summaries
against numpy, the keyed sample of N, fine-tuning that cannot move the model = the global
scores, 1 and 3 ranks bit for bit, client groups, resume, and the refusals."""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfg
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime.federation import local_test_split

from conftest import fedmpi, needs_mpi
from helpers import (TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file,
                     write_config)

SPLIT = merged(TINY, partition={**TINY["partition"], "local_test": 0.25},
               eval={**TINY["eval"], "clients": "all"})
TUNED = merged(SPLIT, eval={**SPLIT["eval"], "client_finetune_epochs": 2})
DETERMINISTIC = {**TINY["system"], "deterministic": True}


def test_each_client_keeps_a_stratified_share_for_its_test_split():
    rng = np.random.default_rng(1)
    sizes = np.array([0, 1, 2, 3, 9, 40, 311])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    indices = rng.permutation(2000)[:offsets[-1]].astype(np.int64)
    labels = rng.integers(0, 4, 2000)
    train_off, train, test_off, test = local_test_split(offsets, indices, labels, 0.3, 7)
    want = [0, 0, 1, 1, 3, 12, 93]           # round(0.3 n) in [1, n - 1]; none below n = 2
    assert np.diff(test_off).tolist() == want
    assert np.diff(train_off).tolist() == (sizes - want).tolist()
    for c, n in enumerate(sizes):
        mine, tr = indices[offsets[c]:offsets[c + 1]], train[train_off[c]:train_off[c + 1]]
        te = test[test_off[c]:test_off[c + 1]]
        assert sorted(np.concatenate([tr, te]).tolist()) == sorted(mine.tolist())
        assert (np.diff(tr) > 0).all() and (np.diff(te) > 0).all()
        for label in range(4):               # systematic sampling: each label within one
            share = want[c] * (labels[mine] == label).sum() / max(n, 1)
            assert abs((labels[te] == label).sum() - share) < 1 + 1e-9
    again = local_test_split(offsets, indices, labels, 0.3, 7)
    assert all(np.array_equal(a, b) for a, b in zip(again, (train_off, train, test_off, test)))
    other = local_test_split(offsets, indices, labels, 0.3, 8)[3]
    assert not np.array_equal(other, test)   # keyed by the seed


def _direct_scores(run, values, split="local_test"):
    """Each client's (correct, loss sum, n) on its local test split (``split`` "client":
    its training samples), the final model scored here by hand."""
    from fedmpi.data import load_dataset
    from fedmpi.models import build_model
    from fedmpi.runtime.clientdata import DeviceData

    c = cfg.from_dict(values)
    data = load_dataset(c.data.dataset, seed=c.seed, **c.data.options)
    module = build_model(c.model.name, data.in_channels, data.num_classes, data.image_size,
                         **c.model.options)
    module.load_state_dict({k: torch.as_tensor(v) for k, v in run.state_dict().items()})
    device = DeviceData(data, torch.device("cpu"), augment=False, crop_padding=0, flip=False,
                        channels_last=False)
    p = run.partition()
    out = {}
    with torch.no_grad():
        for client in range(c.clients.num):
            ids = p[f"{split}_indices"][p[f"{split}_offsets"][client]:
                                        p[f"{split}_offsets"][client + 1]]
            logits = module(device.prepare(device.train_x[ids], None))
            y = device.train_y[ids]
            out[client] = (int((logits.argmax(1) == y).sum()),
                           float(F.cross_entropy(logits, y, reduction="sum")), len(ids))
    return out


def test_every_client_is_scored_on_its_split_and_the_summaries_follow(tmp_path):
    with run_file(tmp_path, "run", SPLIT) as r:
        table, rounds, p = r.client_eval(), r.rounds(), r.partition()
        direct = _direct_scores(r, SPLIT)
        plain = r.partition()["client_sizes"]
    with run_file(tmp_path, "nosplit", TINY) as r:
        whole = r.partition()
    assert (plain + p["local_test_sizes"] == np.diff(whole["client_offsets"])).all()
    last = table["round"] == SPLIT["rounds"]
    assert table["client"][last].tolist() == list(range(12))
    for client, acc, loss, n in zip(table["client"][last], table["accuracy"][last],
                                    table["loss"][last], table["n_test"][last]):
        correct, total, size = direct[int(client)]
        assert n == size and acc == correct / size
        assert loss == pytest.approx(total / size, rel=1e-5)
    assert sorted(set(table["round"].tolist())) == [0, 1, 2, 3]
    for t in range(4):
        rows = table["round"] == t
        acc, n = table["accuracy"][rows], table["n_test"][rows]
        assert rounds["client_acc_mean"][t] == pytest.approx(acc.mean(), abs=1e-12)
        assert rounds["client_acc_weighted"][t] == pytest.approx((acc * n).sum() / n.sum(), abs=1e-12)
        assert rounds["client_acc_std"][t] == pytest.approx(acc.std(), abs=1e-12)
        assert rounds["client_acc_p10"][t] == pytest.approx(np.percentile(acc, 10), abs=1e-12)
        assert rounds["client_acc_worst10"][t] == pytest.approx(np.sort(acc)[:2].mean(), abs=1e-12)
        assert rounds["clients_evaluated"][t] == 12


def test_a_sample_of_n_clients_is_the_same_every_evaluation(tmp_path):
    values = merged(SPLIT, eval={**SPLIT["eval"], "clients": 5, "every": 2}, rounds=4)
    with run_file(tmp_path, "run", values) as r:
        table, rounds = r.client_eval(), r.rounds()
    by_round = {t: table["client"][table["round"] == t].tolist() for t in (0, 2, 4)}
    assert len(by_round[0]) == 5 and by_round[0] == by_round[2] == by_round[4]
    assert np.isnan(rounds["client_acc_mean"][[1, 3]]).all()   # not an evaluation round


def test_fine_tuning_that_cannot_move_the_model_scores_as_the_global_model(tmp_path):
    """At lr 1e-30 every step leaves each weight where it is (below its float spacing),
    so the personalised scores are the global model's: the same accuracy, the loss to
    rounding (each client's samples are scored in chunks of their own)."""
    still = merged(TUNED, rounds=1, train={**TINY["train"], "lr": 1e-30})
    with run_file(tmp_path, "run", still) as r:
        table = r.client_eval()
    assert np.array_equal(table["personal_accuracy"], table["accuracy"])
    assert np.allclose(table["personal_loss"], table["loss"], rtol=1e-6, atol=0)


def test_fine_tuning_moves_the_scores_and_leaves_the_training_alone(tmp_path):
    with run_file(tmp_path, "tuned", TUNED) as tuned, run_file(tmp_path, "plain", SPLIT) as plain:
        assert np.array_equal(tuned.model(), plain.model())
        a, b = tuned.client_eval(), plain.client_eval()
        assert np.array_equal(a["accuracy"], b["accuracy"])
        assert not np.array_equal(a["personal_accuracy"], a["accuracy"])
        assert np.isfinite(tuned.rounds()["personal_acc_mean"]).all()


def test_fine_tuning_in_groups_follows_one_client_after_another(tmp_path):
    """eval.client_finetune_group = 4: every client's fine-tuned scores as one after
    another up to float rounding (each row from its own start, over its own batches); the
    global scores and the training untouched, bit for bit."""
    one = merged(TUNED, rounds=2)
    grouped = merged(one, eval={**one["eval"], "client_finetune_group": 4})
    with run_file(tmp_path, "one", one) as a, run_file(tmp_path, "grouped", grouped) as b:
        assert np.array_equal(a.model(), b.model())
        ta, tb = a.client_eval(), b.client_eval()
        for name in ("client", "accuracy", "loss", "n_test"):
            assert np.array_equal(ta[name], tb[name]), name
        np.testing.assert_allclose(tb["personal_loss"], ta["personal_loss"], rtol=1e-4)
        assert np.abs(tb["personal_accuracy"] - ta["personal_accuracy"]).max() <= 0.1
        assert not np.array_equal(ta["personal_loss"], ta["loss"])   # it did fine-tune
    vgg = merged(grouped)
    vgg["model"] = {"name": "vgg11"}
    with pytest.raises(UsageError, match="eval.client_finetune_group: model 'vgg11' has dropout"):
        cfg.from_dict(vgg)


def test_round_0_scores_do_not_depend_on_the_client_group(tmp_path):
    """The initial model's per-client scores (nothing trained yet) with clients trained one
    after another and in groups of 4: bit for bit (fine-tuning one after another in both)."""
    rows = []
    for group in (1, 4):
        values = merged(TUNED, rounds=1, system={**TINY["system"], "client_group": group})
        with run_file(tmp_path, f"g{group}", values) as r:
            table = r.client_eval()
            rows.append({k: v[table["round"] == 0] for k, v in table.items()})
    for name in rows[0]:
        assert np.array_equal(rows[0][name], rows[1][name]), name


def test_held_out_clients_never_train_and_give_the_two_gaps(tmp_path):
    values = merged(SPLIT, clients={**TINY["clients"], "holdout": 0.25}, rounds=4)
    with run_file(tmp_path, "run", values) as r:
        table, rounds, p, trained = r.client_eval(), r.rounds(), r.partition(), r.clients()
        test, train = _direct_scores(r, values), _direct_scores(r, values, "client")
    held = p["holdout_slots"].tolist()
    assert len(held) == 3 and not set(held) & set(trained["client"].tolist())
    assert sorted(set(trained["client"].tolist())) == sorted(set(range(12)) - set(held))
    last = table["round"] == 4
    assert [c for c, h in zip(table["client"][last], table["held_out"][last]) if h] == held
    acc = {int(c): test[int(c)][0] / test[int(c)][2] for c in range(12)}
    ours = [c for c in range(12) if c not in held]
    fit = np.mean([train[c][0] / train[c][2] for c in ours])
    assert rounds["holdout_acc_mean"][4] == pytest.approx(np.mean([acc[c] for c in held]), abs=1e-12)
    assert rounds["client_acc_mean"][4] == pytest.approx(np.mean([acc[c] for c in ours]), abs=1e-12)
    assert rounds["client_train_acc_mean"][4] == pytest.approx(fit, abs=1e-12)
    assert rounds["participation_gap"][4] == pytest.approx(
        rounds["client_acc_mean"][4] - rounds["holdout_acc_mean"][4], abs=1e-15)
    assert rounds["out_of_sample_gap"][4] == pytest.approx(fit - rounds["client_acc_mean"][4],
                                                           abs=1e-12)
    one = fedmpi(["report", str(tmp_path / "run.h5")])     # one run: its summary
    assert one.returncode == 0, one.stderr
    assert f"participation {100 * rounds['participation_gap'][4]:.2f}%" in one.stdout
    assert f"mean {100 * rounds['holdout_acc_mean'][4]:.2f}% over clients" in one.stdout
    from fedmpi.analysis import load
    from fedmpi.analysis.report import report_table
    table = report_table(load(str(tmp_path / "run.h5")))     # as for several runs
    assert all(h in table.splitlines()[0] for h in ("local %", "local w10 %", "new %", "part. gap %"))


@pytest.mark.slow
@needs_mpi
def test_fine_tuning_groups_are_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    """Fine-tuning groups are cut from all evaluated clients and placed whole."""
    values = merged(TUNED, system=DETERMINISTIC,
                    eval={**TUNED["eval"], "client_finetune_group": 3})
    assert_same_on_3_ranks(tmp_path, values, ["personal_acc_mean", "personal_loss"],
                           client_eval=True)


@pytest.mark.slow
@needs_mpi
def test_per_client_scores_are_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    assert_same_on_3_ranks(tmp_path, merged(TUNED, system=DETERMINISTIC),
                           ["client_acc_mean", "client_acc_worst10", "personal_acc_mean",
                            "personal_loss"], client_eval=True)


def test_a_resumed_run_has_the_same_client_rows(tmp_path):
    crashed, _ = run_and_resume(merged(TUNED, system=DETERMINISTIC), tmp_path)
    with RunFile(tmp_path / "ref.h5") as ref, RunFile(crashed) as resumed:
        for name, column in ref.client_eval().items():
            assert np.array_equal(column, resumed.client_eval()[name]), name


@pytest.mark.parametrize("over, message", [
    ({"partition": {**TINY["partition"], "local_test": 1.0}},
     "partition.local_test: must be a fraction in [0, 1)"),
    ({"partition": {**TINY["partition"], "local_test": math.nan}},
     "partition.local_test: must be a finite number, got nan"),
    ({"partition": {**TINY["partition"], "local_test": -0.1}},
     "partition.local_test: must be a fraction in [0, 1)"),
    ({"eval": {**TINY["eval"], "clients": "some"}},
     'eval.clients: must be "none", "all" or a number of clients, got \'some\''),
    ({"eval": {**SPLIT["eval"], "clients": 13}},
     "eval.clients: must be from 1 to clients.num = 12"),
    ({"eval": {**SPLIT["eval"], "clients": 0}}, "eval.clients: must be from 1 to clients.num"),
    ({"partition": {"local_test": 0.0}},
     "eval.clients: scores each client on its local test split; needs partition.local_test > 0"),
    ({"eval": {**TUNED["eval"], "client_finetune_epochs": -1}},
     "eval.client_finetune_epochs: must be an integer >= 0"),
    ({"eval": {"clients": "none", "client_finetune_epochs": 2}},
     "eval.client_finetune_epochs: fine-tunes the evaluated clients; needs eval.clients"),
    ({"eval": {**TUNED["eval"], "client_finetune_group": 0}},
     "eval.client_finetune_group: must be an integer in [1, 4096] (1: one client after another)"),
    ({"eval": {**SPLIT["eval"], "client_finetune_group": 4}},
     "eval.client_finetune_group: groups the fine-tuning; needs eval.client_finetune_epochs > 0"),
    ({"clients": {**TINY["clients"], "holdout": 1.0}}, "clients.holdout: must be a fraction in [0, 1)"),
    ({"clients": {**TINY["clients"], "holdout": 0.7}},
     "clients.holdout: holds out 8 of clients.num = 12, fewer than clients.per_round = 5 left"),
    ({"clients": {**TINY["clients"], "holdout": 0.1}, "eval": {"clients": "none"}},
     "clients.holdout: held-out clients are only evaluated; needs eval.clients"),
    ({"clients": {**TINY["clients"], "holdout": 0.1},
      "privacy": {"mechanism": "central", "noise_multiplier": 1.0}},
     "clients.holdout: the privacy accounting's sampling rate is per_round / num"),
    ({"clients": {**TINY["clients"], "holdout": 0.1},
      "system_model": {"profiles": "lognormal", "policy": "fedbuff"}},
     "clients.holdout: asynchronous rounds draw from the whole population"),
    ({"algorithm": {"name": "fedsimclr"}, "model": {**TINY["model"], "proj_dim": 8}},
     "eval.clients: scores a classifier on each client's test split; algorithm 'fedsimclr'"),
])
def test_what_per_client_evaluation_cannot_take_is_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(SPLIT, **over))


def test_a_refusal_is_one_line_exit_2_and_no_file(tmp_path):
    out = tmp_path / "run.h5"
    path = write_config(tmp_path / "bad.toml", merged(SPLIT, eval={**SPLIT["eval"], "clients": 99}),
                        output=str(out))
    proc = fedmpi(["run", str(path), "-q"])
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        'fedmpi: config field eval.clients: must be from 1 to clients.num = 12 (or "all"), got 99']


def test_fine_tuning_groups_refuse_batchnorm_statistics_before_the_file(tmp_path):
    out = tmp_path / "run.h5"
    values = merged(TUNED, model={**TINY["model"], "norm": "batch"},
                    eval={**TUNED["eval"], "client_finetune_group": 4})
    proc = fedmpi(["run", str(write_config(tmp_path / "bn.toml", values, output=str(out))), "-q"])
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        "fedmpi: config field eval.client_finetune_group: the model has float buffers "
        "(BatchNorm statistics), which a client group cannot carry per client; set 1 (one "
        "client after another)"]
