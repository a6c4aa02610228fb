"""Adaptive clipping (``privacy.clip_quantile``; Andrew et al. 2021, in the CentralNoise
and ClipUpdate stages of fedmpi.runtime.dp): the clip's geometric update in closed form,
a still clip is the fixed clip bit for bit with the two extra values counted on the
wire, the noise split between the updates and the count, a resume, and the refusals."""

import math
import re

import h5py
import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi import privacy
from fedmpi.errors import UsageError
from fedmpi.results import RunFile

from helpers import TINY, merged, run_and_resume, run_file

# 12 clients, 4 a round drawn uniformly: S = 4 every round, so without noise the unclipped
# fraction is the count of unclipped clients / 4 exactly
BASE = merged({**TINY, "partition": {"kind": "iid"}}, rounds=3,
              data={**TINY["data"], "num_train": 384}, clients={"num": 12, "per_round": 4},
              system={**TINY["system"], "deterministic": True})
ADAPTIVE = {"mechanism": "central", "clip": 1.0, "noise_multiplier": 0.0,
            "clip_quantile": 0.5, "clip_lr": 0.2}


def run(tmp_path, name, **privacy_section):
    return run_file(tmp_path, name, merged(BASE, privacy={**ADAPTIVE, **privacy_section}))


@pytest.mark.parametrize("clip, unclipped", [(1e6, 1.0), (1e-6, 0.0)])
def test_the_clip_moves_geometrically_toward_the_quantile(tmp_path, clip, unclipped):
    """No noise: every update under a huge clip (b = 1), or over a tiny one (b = 0), so
    C_t = C_0 exp(-t eta (b - gamma)), rounded to float32 each round as it is sent."""
    with run(tmp_path, "run", clip=clip) as r:
        rounds = r.rounds()
    assert rounds["dp_unclipped"][1:].tolist() == [unclipped] * 3
    want = [clip]
    for _ in range(2):
        want.append(float(np.float32(want[-1] * math.exp(-0.2 * (unclipped - 0.5)))))
    assert rounds["dp_clip"][1:].tolist() == pytest.approx([float(np.float32(w)) for w in want],
                                                           rel=1e-6)


def test_a_clip_that_does_not_move_is_the_fixed_clip_with_two_values_more_on_the_wire(tmp_path):
    with run(tmp_path, "fixed", clip=0.05, clip_quantile=0.0) as fixed, \
            run(tmp_path, "still", clip=0.05, clip_lr=0.0) as still:
        assert np.array_equal(fixed.model(), still.model())
        a, b = fixed.rounds(), still.rounds()
        assert np.array_equal(a["test_acc"], b["test_acc"], equal_nan=True)
        assert b["dp_clip"][1:].tolist() == [np.float32(0.05)] * 3
        n = a["n_participants"][1:]
        for direction in ("fl_bytes_down", "fl_bytes_up"):   # C_t down, the bit up
            assert (b[direction][1:] - a[direction][1:]).tolist() == (4 * n).tolist()
        assert "dp_clip" not in a


def test_the_noise_is_split_between_the_updates_and_the_count():
    c = cfg.from_dict(merged(BASE, privacy={**ADAPTIVE, "noise_multiplier": 1.0,
                                            "count_noise": 2.0}))
    assert privacy.count_std(c) == 2.0
    assert privacy.update_noise_multiplier(c) == pytest.approx((1 - 1 / 16) ** -0.5)
    default = cfg.from_dict(merged(BASE, clients={"num": 12, "per_round": 4},
                                   privacy={**ADAPTIVE, "noise_multiplier": 0.1}))
    assert privacy.count_std(default) == 4 / 20          # Andrew et al.: S / 20
    described = privacy.describe(c)
    assert described["privacy_count_noise"] == 2.0 and described["privacy_clip_quantile"] == 0.5
    assert described["privacy_update_noise_multiplier"] == privacy.update_noise_multiplier(c)


def test_a_resume_continues_the_clip_from_the_checkpoint(tmp_path):
    values = merged(BASE, rounds=5, system={**BASE["system"], "checkpoint_every": 2},
                    privacy={**ADAPTIVE, "clip": 0.05, "noise_multiplier": 0.5,
                             "count_noise": 1.0})
    crashed, _ = run_and_resume(values, tmp_path)   # from the checkpoint after round 4
    ref = tmp_path / "ref.h5"
    with h5py.File(ref, "r") as f:
        assert f["checkpoint"].attrs["round"] == 4
        assert "dp_clip" in f["checkpoint/slot0/server"] or "dp_clip" in f["checkpoint/slot1/server"]
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        for name in ("dp_clip", "dp_unclipped", "epsilon"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)
        assert len(set(a.rounds()["dp_clip"][1:])) == 5   # it moved


def test_a_count_noise_that_swamps_the_count_cannot_overflow_the_clip(tmp_path):
    """sigma_b = 1e6 against 4 clients: the noisy fraction is read as one in [0, 1] (post-
    processing), so C moves by at most exp(eta_C) a round and stays finite and positive."""
    with run(tmp_path, "run", clip=1.0, noise_multiplier=1.0, count_noise=1e6,
             clip_lr=10.0) as r:
        rounds = r.rounds()
        assert np.isfinite(r.model()).all()
    clips = rounds["dp_clip"][1:]
    assert np.all((clips >= 1e-30) & (clips <= 1e30))
    steps = clips[1:] / clips[:-1]
    assert np.all((steps >= math.exp(-10 * 0.5) * (1 - 1e-6)) & (steps <= math.exp(10 * 0.5) * (1 + 1e-6)))
    assert np.abs(rounds["dp_unclipped"][1:]).max() > 1e3    # the raw noisy fraction, recorded


@pytest.mark.parametrize("over, message", [
    ({"clip_quantile": 1.0}, "privacy.clip_quantile: must be in (0, 1)"),
    ({"clip_quantile": -0.5}, "privacy.clip_quantile: must be in (0, 1)"),
    ({"clip_lr": -1.0}, "privacy.clip_lr: must be in [0, 10]"),
    ({"clip_lr": 1e300}, "privacy.clip_lr: must be in [0, 10]"),
    ({"clip_lr": math.inf}, "privacy.clip_lr: must be a finite number"),
    ({"count_noise": -1.0}, "privacy.count_noise: must be a finite number >= 0"),
    ({"noise_multiplier": 1.0, "count_noise": 0.4},
     "privacy.count_noise: adaptive clipping splits the noise multiplier 1 between the "
     "updates and the count, which needs 2 sigma_b > it; sigma_b = 0.4"),
])
def test_adaptive_clipping_that_cannot_hold_is_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(BASE, privacy={**ADAPTIVE, **over}))
