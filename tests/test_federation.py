"""Feature skew on the device and the federated split: public set, noise levels, colour
factors, the dynamic population (FedACG Table 3), all stored in the results file."""

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF

from fedmpi import config as cfgmod
from fedmpi.data import load_dataset
from fedmpi.data.augment import ClientSkew, skewed_float, to_float
from fedmpi.errors import UsageError
from fedmpi.runtime.federation import federate
from fedmpi.runtime.plan import sample_clients

from helpers import TINY, merged
from test_runtime import run_tiny

MEAN, STD = (0.25, 0.5, 0.75), (0.2, 0.3, 0.4)


def images(b=6, c=3, h=8, w=8, seed=0):
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def config(**sections):
    return cfgmod.from_dict(merged(TINY, **sections))


# ---- ClientSkew: the device-side transform ------------------------------------------------

def test_colour_factors_match_torchvision():
    x = images()
    skew = ClientSkew(brightness=1.3, saturation=0.4)
    ours = skew.apply(x.float() / 255, torch.Generator())
    theirs = TF.adjust_saturation(TF.adjust_brightness(x.float() / 255, 1.3), 0.4)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_saturation_leaves_grey_images_alone_and_identity_is_exact():
    x = images(c=1)
    assert torch.equal(ClientSkew(saturation=0.2).apply(x.float() / 255, torch.Generator()), x.float() / 255)
    assert ClientSkew().is_identity and not ClientSkew(noise_std=0.1).is_identity
    out = skewed_float(x, ClientSkew(), torch.Generator(), (0.5,), (0.25,))
    torch.testing.assert_close(out, to_float(x, (0.5,), (0.25,)), atol=1e-6, rtol=0)


def test_noise_has_the_clients_std_and_is_keyed_by_the_generator():
    x = torch.full((64, 1, 28, 28), 128, dtype=torch.uint8)
    skew = ClientSkew(noise_std=0.3)
    a = skewed_float(x, skew, torch.Generator().manual_seed(1))
    b = skewed_float(x, skew, torch.Generator().manual_seed(1))
    c = skewed_float(x, skew, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    residual = a - 128 / 255
    assert abs(float(residual.std()) - 0.3) < 0.005 and abs(float(residual.mean())) < 0.005


def test_space_mode_noise_stays_in_the_clients_block():
    x = torch.zeros(4, 1, 12, 12, dtype=torch.uint8)
    out = ClientSkew(noise_std=1.0, block=(3, 5)).apply(x.float(), torch.Generator().manual_seed(0))
    noisy = (out != 0).any(0)[0]
    expected = torch.zeros(12, 12, dtype=torch.bool)
    expected[4:8, 8:12] = True  # cell 5 of a 3 x 3 grid: row 1, column 2, 4 x 4 pixels
    assert torch.equal(noisy, expected)


# ---- the split ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic", seed=3, num_train=600, num_test=200, size=16)


def test_static_split_is_the_partition_and_unskewed_by_default(synthetic):
    split = federate(config(), synthetic)
    assert split.num_identities == 12 and split.sizes.sum() == 600
    assert np.array_equal(np.sort(split.indices), np.arange(600))
    assert split.population.shape == (1, 12) and np.array_equal(split.active(99), np.arange(12))
    assert all(split.skew(c) is None for c in range(12))


def test_noise_levels_follow_fnrfl(synthetic):
    split = federate(config(partition={"noise": 0.5}), synthetic)
    np.testing.assert_allclose(split.noise_std, 0.5 * np.arange(12) / 11)
    assert split.skew(0) is None and split.skew(11).noise_std == 0.5 and split.skew(11).block is None
    space = federate(config(partition={"noise": 0.2, "noise_mode": "space"}), synthetic)
    assert np.all(space.noise_std == 0.2) and space.skew(7).block == (4, 7)


def test_colour_factors_are_per_client_fixed_and_in_range(synthetic):
    cfg = config(partition={"brightness": 0.3, "saturation": 0.5})
    a, b = federate(cfg, synthetic), federate(cfg, synthetic)
    assert np.array_equal(a.brightness, b.brightness) and len(np.unique(a.brightness)) == 12
    assert np.all(np.abs(a.brightness - 1) <= 0.3) and np.all(np.abs(a.saturation - 1) <= 0.5)


def test_dynamic_population(synthetic):
    cfg = config(rounds=40, clients={"replace_prob": 0.5, "replace_every": 10})
    split = federate(cfg, synthetic)
    table = split.population
    assert table.shape == (4, 12) and np.array_equal(table[0], np.arange(12))
    assert np.array_equal(split.active(9), table[0]) and np.array_equal(split.active(10), table[1])
    newcomers = split.num_identities - 12
    assert newcomers == len(np.unique(table)) - 12 and 6 <= newcomers <= 30  # ~ 0.5 x 12 x 3
    for k in range(1, 4):
        changed = table[k] != table[k - 1]
        assert np.all(table[k][changed] >= table[k - 1].max() + 1)  # fresh ids, never reused
        assert np.all(split.identity_stage[table[k][changed]] == k)
        assert np.array_equal(split.identity_slot[table[k]], np.arange(12))
    for c in range(split.num_identities):  # every identity owns real, distinct samples
        assert len(np.unique(split.client(c))) == len(split.client(c)) > 0
    again = federate(cfg, synthetic)
    assert np.array_equal(again.indices, split.indices) and np.array_equal(again.population, table)
    sampled = split.sample(sample_clients(3, 25, 12, 5), 25)
    assert set(sampled.tolist()) <= set(table[2].tolist()) and np.all(np.diff(sampled) > 0)


@pytest.mark.parametrize("field, value, words", [
    ("partition", {"noise": -0.1}, "partition.noise"),
    ("partition", {"brightness": 1.5}, "partition.brightness"),
    ("partition", {"noise_mode": "pixel"}, "partition.noise_mode"),
    ("clients", {"replace_prob": 0.5}, "clients.replace_prob"),
    ("clients", {"replace_prob": 1.5, "replace_every": 3}, "clients.replace_prob"),
])
def test_bad_skew_settings_are_one_line_errors(field, value, words):
    with pytest.raises(UsageError, match=words.replace(".", r"\.")) as err:
        config(**{field: value})
    assert "\n" not in str(err.value)


def test_runtime_stores_the_split_and_trains_fresh_clients(tmp_path):
    """SCAFFOLD keeps a control variate per client: a newcomer must start from none."""
    _, _, run = run_tiny(tmp_path, rounds=6, algorithm={"name": "scaffold"},
                    clients={"num": 12, "per_round": 6, "replace_prob": 0.5, "replace_every": 2},
                    partition={"noise": 0.3, "brightness": 0.2})
    with run:
        part = run.partition()
        table, clients = part["population"], run.clients()
        assert table.shape == (3, 12) and run.status == "completed"
        for r, c in zip(clients["round"], clients["client"]):
            assert c in table[(int(r) - 1) // 2]
        assert part["client_offsets"][-1] == len(part["client_indices"])
        assert part["class_counts"].shape == (len(part["client_sizes"]), 10)
        np.testing.assert_allclose(part["noise_std"], 0.3 * part["identity_slot"] / 11)
        assert np.isfinite(run.rounds()["test_acc"]).all()
