"""Data poisoning (fedmpi.runtime.poison): a malicious client's batches are its honest
batches with the labels mapped (label flipping) or a keyed share stamped with the trigger
and relabelled (backdoor), on the per-client path even where client groups would gather;
the attack's success is counted as a direct count over the test set; honest clients and
the test set are never touched; refusals name the field."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.runtime.clientdata import DeviceData, TensorClientData
from fedmpi.runtime.poison import AttackSuccess, Poisoning, label_map

from conftest import needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_file

C, H = 4, 8


def _dataset(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 200, (n, 1, H, H), generator=g, dtype=torch.uint8)
    y = torch.randint(0, C, (n,), generator=g)
    return SimpleNamespace(train_x=x, train_y=y, test_x=x.clone(), test_y=y.clone(),
                           mean=(0.5,), std=(0.25,), modality="image", num_classes=C)


def _config(**attack):
    return cfg.from_dict(merged(TINY, attack={"fraction": 0.5, **attack}))


def _data(ds):
    return DeviceData(ds, torch.device("cpu"), augment=False, crop_padding=0, flip=False,
                      channels_last=False)


def _batches(data, indices, poison):
    view = data.client(indices, 3, 1, 0, 0, poison=poison)
    return [(x.clone(), y.clone()) for x, y in view.batches(2, 7)]


def _bad_client(config):
    poisoning = Poisoning(config, _dataset(), torch.device("cpu"), supervised=True)
    return poisoning, min(poisoning.ids)


def test_label_flipping_maps_every_label_and_nothing_else():
    assert label_map(4, -1, "cpu").tolist() == [3, 2, 1, 0]
    assert label_map(4, 2, "cpu").tolist() == [2, 2, 2, 2]
    ds, indices = _dataset(), np.arange(5, 30)
    data = _data(ds)
    poisoning, bad = _bad_client(_config(kind="label_flip"))
    honest = _batches(data, indices, None)
    flipped = _batches(data, indices, poisoning.client(bad, indices))
    for (x, y), (px, py) in zip(honest, flipped):
        assert torch.equal(x, px) and torch.equal(py, C - 1 - y)
    assert poisoning.client(max(set(range(12)) - poisoning.ids), indices) is None


def test_a_backdoor_stamps_the_same_keyed_share_every_round_and_relabels_it():
    ds, indices = _dataset(), np.arange(40)
    data = _data(ds)
    config = _config(kind="backdoor", target=1, trigger=3, poison_fraction=0.25)
    poisoning, bad = _bad_client(config)
    poison = poisoning.client(bad, indices)
    assert len(poison.chosen) == 10 and torch.equal(poison.chosen,
                                                    poisoning.client(bad, indices).chosen)
    white = (1.0 - 0.5) / 0.25   # 255 as the model sees it (mean 0.5, std 0.25)

    def corner(t):
        return (t[:, :, H - 3:, H - 3:] == white).flatten(1).all(1)
    stamped = 0
    for (x, y), (px, py) in zip(_batches(data, indices, None), _batches(data, indices, poison)):
        same = (x == px).flatten(1).all(1)
        assert torch.equal(py[same], y[same])
        assert corner(px[~same]).all() and (py[~same] == 1).all()
        assert torch.equal(x[~same][:, :, :H - 3], px[~same][:, :, :H - 3])
        stamped += int((~same).sum())
    # two epochs, each chosen sample once an epoch (a chosen one already white: unchanged)
    assert stamped <= 2 * 10 and stamped >= 2 * 10 - int(corner(_data(ds).prepare(
        ds.train_x[poison.chosen], None)).sum()) * 2
    assert not (ds.train_x[:, :, H - 3:, H - 3:] == 255).all()   # the shared set untouched


def test_a_poisoned_client_in_a_group_takes_the_per_client_path():
    ds, indices = _dataset(), np.arange(5, 30)
    data = _data(ds)
    poisoning, bad = _bad_client(_config(kind="label_flip"))
    views = [data.client(indices, 3, 1, c, 0, poison=poisoning.client(c, indices))
             for c in (bad, bad + 100)]
    assert views[1].poison is None and views[0].poison is not None
    grouped = list(TensorClientData.group_batches(views, 1, 7))
    poisoned = [y for _, y in views[0].batches(1, 7)]
    honest = [y for _, y in views[1].batches(1, 7)]
    for (_, y, _), bad_y, good_y in zip(grouped, poisoned, honest):   # row 0: its own labels
        assert torch.equal(y[0, :len(bad_y)], bad_y) and torch.equal(y[1, :len(good_y)], good_y)
    assert not torch.equal(poisoned[0], honest[0])


class _Corner(torch.nn.Module):
    """Class 0 where the bottom-right pixel is the trigger's white, else class 3."""

    def forward(self, x):
        bright = x[:, 0, -1, -1] >= (1.0 - 0.5) / 0.25 - 1e-4
        out = torch.zeros(len(x), C)
        out[bright, 0] = 1.0
        out[~bright, 3] = 1.0
        return out


def _success(kind, target, module):
    ds = _dataset(50, seed=1)
    exp = SimpleNamespace(comm=LocalComm(), eval_batch=16, data=_data(ds), num_classes=C,
                          flat=SimpleNamespace(module=module))
    stage = AttackSuccess(_config(kind=kind, target=target))
    timers = SimpleNamespace(eval=0.0)
    return stage.evaluate(exp, timers, 1)[0]["attack_success"], ds.test_y.numpy()


def test_attack_success_is_the_share_of_moved_test_samples_on_the_attacker_s_label():
    asr, y = _success("backdoor", 0, _Corner())
    assert asr == 1.0                                     # every stamped sample is caught
    asr, y = _success("label_flip", -1, _Corner())        # nothing stamped: predicts 3
    moved = (C - 1 - y) != y
    assert np.isclose(asr, np.mean((C - 1 - y)[moved] == 3))
    asr, y = _success("label_flip", 3, _Corner())
    assert asr == 1.0


def test_label_flipping_records_its_success_and_its_attackers(tmp_path):
    values = merged(TINY, rounds=2, attack={"kind": "label_flip", "fraction": 0.5, "target": 1})
    with run_file(tmp_path, "flip", values) as r:
        rounds, c = r.rounds(), r.clients()
        bad = set(r.partition()["malicious"].tolist())
    assert np.all(np.isfinite(rounds["attack_success"]))
    assert set(c["client"][c["malicious"] == 1]) <= bad
    assert set(c["client"][c["malicious"] == 0]).isdisjoint(bad)


@pytest.mark.parametrize("attack, message", [
    ({"kind": "label_flip", "target": 10}, "attack.target: must be -1 or a class in [0, 10)"),
    ({"kind": "backdoor", "target": 0, "trigger": 17},
     "attack.trigger: 17 pixels does not fit the 16x16 images of 'synthetic'"),
])
def test_what_the_dataset_cannot_take_is_refused_at_start(tmp_path, attack, message):
    values = merged(TINY, attack={"fraction": 0.2, **attack})
    with pytest.raises(UsageError, match=re.escape(message)):
        with run_file(tmp_path, "bad", values):
            pass
    assert not list(tmp_path.glob("*.h5"))


def test_a_self_supervised_method_has_no_labels_to_poison():
    with pytest.raises(UsageError, match="attack.kind: 'label_flip' poisons labels"):
        Poisoning(_config(kind="label_flip"), _dataset(), torch.device("cpu"), supervised=False)


def test_fedmpi_report_shows_the_attack_s_success(tmp_path):
    from fedmpi.analysis.report import report_table
    from fedmpi.analysis.runs import load
    values = merged(TINY, rounds=1, attack={"kind": "backdoor", "fraction": 0.5, "target": 0})
    with run_file(tmp_path, "door", values) as r:
        asr = r.rounds()["attack_success"][-1]
    table = report_table(load(tmp_path))
    assert "attack %" in table and f"{100 * asr:.2f}" in table


@pytest.mark.slow
@needs_mpi
def test_a_backdoor_run_is_the_same_bits_under_mpirun(tmp_path):
    values = merged(TINY, system={**TINY["system"], "deterministic": True},
                    attack={"kind": "backdoor", "fraction": 0.5, "target": 2})
    assert_same_on_3_ranks(tmp_path, values, columns=("test_loss", "attack_success"))
