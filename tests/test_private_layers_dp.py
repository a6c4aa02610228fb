"""[privacy] with private layers (fedmpi.runtime.partial, fedmpi.runtime.dp): only the
shared coordinates are released, so only they are clipped and noised and the accounting
is the same; no noise and a clip that never binds is the method without DP, bit for bit;
the private layers never see noise; 1 and 3 ranks agree."""

import numpy as np
import pytest


from conftest import needs_mpi
from helpers import EQUAL_SIZES, TINY, assert_same_on_3_ranks, merged, run_file

EQUAL = merged(EQUAL_SIZES, algorithm={"name": "fedper"})
CENTRAL = {"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0}


def test_no_noise_and_a_clip_that_never_binds_is_fedper_bit_for_bit(tmp_path):
    with run_file(tmp_path, "plain", EQUAL) as plain, \
            run_file(tmp_path, "dp", merged(EQUAL, privacy={**CENTRAL, "clip": 1e30,
                                                            "noise_multiplier": 0.0})) as dp:
        assert np.array_equal(plain.model(), dp.model())
        assert np.array_equal(plain.rounds()["test_loss"], dp.rounds()["test_loss"],
                              equal_nan=True)
        assert dp.attrs["shared_params"] < dp.attrs["num_params"]


def test_the_noise_lands_on_the_shared_coordinates_only(tmp_path):
    """Clients that do not move (lr 1e-30): the global model moves by the noise alone, on
    every shared coordinate and on no private one."""
    still = merged(EQUAL, rounds=1, train={**TINY["train"], "lr": 1e-30})
    with run_file(tmp_path, "quiet", merged(still, privacy={**CENTRAL, "noise_multiplier": 0.0})) as a, \
            run_file(tmp_path, "noisy", merged(still, privacy={**CENTRAL, "clip": 0.5,
                                                                "noise_multiplier": 2.0})) as b:
        moved = b.model().astype(np.float64) - a.model().astype(np.float64)
        shared, total = b.attrs["shared_params"], b.attrs["num_params"]
        assert np.isfinite(b.rounds()["epsilon"][-1])
    still_coordinates = moved == 0
    assert still_coordinates.sum() == total - shared        # the private layers, exactly
    assert abs(moved[~still_coordinates].std() / (2.0 * 0.5 / 4) - 1) < 0.2


@pytest.mark.parametrize("mechanism, extra", [
    ("local", {"clip": 1.0, "noise_multiplier": 0.5}),
    ("sample", {"clip": 1.0, "noise_multiplier": 0.5}),
])
def test_local_dp_and_dp_sgd_run_with_private_layers(tmp_path, mechanism, extra):
    values = merged(EQUAL, algorithm={"name": "lg_fedavg"},
                    privacy={"mechanism": mechanism, **extra})
    with run_file(tmp_path, mechanism, values) as r:
        assert r.status == "completed" and np.isfinite(r.rounds()["epsilon"][-1])


@pytest.mark.slow
@needs_mpi
def test_dp_fedper_is_the_same_bits_on_3_ranks(tmp_path):
    assert_same_on_3_ranks(tmp_path, merged(EQUAL, privacy=CENTRAL), columns=("test_loss",))
