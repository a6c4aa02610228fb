"""Per-client evaluation under feature skew (fedmpi.runtime.client_eval.SkewedSets): each
client's local test split is scored as its skew leaves it (FedBN's setting), the same
images at every evaluation, whatever the chunking or the number of ranks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfg

from conftest import needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_file

SPLIT = merged(TINY, partition={**TINY["partition"], "local_test": 0.25},
               eval={**TINY["eval"], "clients": "all"})
BRIGHT = merged(SPLIT, partition={**SPLIT["partition"], "brightness": 0.5})


def _bright_scores(run, values):
    """Each client's (correct, loss sum) on its local test split with its brightness
    factor applied by hand: x / 255 * b, clamped to [0, 1], then normalised."""
    from fedmpi.data import load_dataset
    from fedmpi.models import build_model

    c = cfg.from_dict(values)
    data = load_dataset(c.data.dataset, seed=c.seed, **c.data.options)
    module = build_model(c.model.name, data.in_channels, data.num_classes, data.image_size,
                         **c.model.options)
    module.load_state_dict({k: torch.as_tensor(v) for k, v in run.state_dict().items()})
    p = run.partition()
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)
    out = {}
    with torch.no_grad():
        for client in range(c.clients.num):
            ids = p["local_test_indices"][p["local_test_offsets"][client]:
                                          p["local_test_offsets"][client + 1]]
            x = (data.train_x[ids].float() / 255 * float(p["brightness"][client])).clamp(0, 1)
            logits = module((x - mean) / std)
            y = data.train_y[ids]
            out[client] = (int((logits.argmax(1) == y).sum()),
                           float(F.cross_entropy(logits, y, reduction="sum")))
    return out


def test_each_client_is_scored_with_its_own_brightness(tmp_path):
    with run_file(tmp_path, "bright", BRIGHT) as r:
        table = r.client_eval()
        direct = _bright_scores(r, BRIGHT)
        factors = r.partition()["brightness"]
    assert len(set(np.round(factors, 6))) > 1
    last = table["round"] == BRIGHT["rounds"]
    for client, acc, loss, n in zip(table["client"][last], table["accuracy"][last],
                                    table["loss"][last], table["n_test"][last]):
        correct, total = direct[int(client)]
        assert acc == correct / n
        assert loss == pytest.approx(total / n, rel=1e-4)


def test_noisy_test_images_do_not_depend_on_the_chunking(tmp_path):
    noisy = merged(SPLIT, rounds=1, partition={**SPLIT["partition"], "noise": 0.3})
    with run_file(tmp_path, "a", noisy) as a, \
            run_file(tmp_path, "b", merged(noisy, eval={**noisy["eval"], "batch_size": 7})) as b:
        one, other = a.client_eval(), b.client_eval()
    assert np.array_equal(one["accuracy"], other["accuracy"])
    assert np.allclose(one["loss"], other["loss"], rtol=1e-6)


@pytest.mark.slow
@needs_mpi
def test_fedbn_under_feature_skew_is_the_same_bits_on_3_ranks(tmp_path):
    values = merged(SPLIT, algorithm={"name": "fedbn"},
                    model={**TINY["model"], "norm": "batch"},
                    partition={**SPLIT["partition"], "noise": 0.3, "brightness": 0.3},
                    system={**TINY["system"], "deterministic": True})
    assert_same_on_3_ranks(tmp_path, values, columns=("client_acc_mean",), client_eval=True)
