"""The protocol carries extra payloads, client state, gathered scalars, two phases and
server state: a toy algorithm with a closed-form answer, through the real runtime."""

import numpy as np

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

import toy_algorithms
from helpers import TINY


def toy_config(tmp_path, **over):
    values = dict(TINY, plugins=["toy_algorithms"], algorithm={"name": "toy_probe"},
                  rounds=4, output=str(tmp_path / "toy.h5"), **over)
    return cfg.from_dict(values)


def test_toy_protocol_matches_closed_form(tmp_path):
    c = toy_config(tmp_path)
    exp = run_experiment(c, LocalComm(), quiet=True)
    with RunFile(c.output_path()) as run:
        x0 = exp.flat.params.detach().numpy()  # untouched: the toy never trains the model
        x, visits, fl = toy_algorithms.reference(_initial(c), c.seed, c.rounds, c.clients.num,
                                                 c.clients.per_round)
        np.testing.assert_allclose(run.model(), x, rtol=1e-5, atol=1e-5)
        rounds = run.rounds()
        assert (rounds["fl_bytes_down"] + rounds["fl_bytes_up"]).tolist() == [0] + fl   # 0: round 0
        clients = run.clients()
        train = clients["phase"] == 0
        assert train.sum() == c.rounds * c.clients.per_round
        assert (clients["phase"] == 1).sum() == 2 * c.rounds
        # visits gathered per client equal how often it was sampled so far
        seen = {}
        for r, cl, v in zip(clients["round"][train], clients["client"][train], clients["visits"][train]):
            seen[cl] = seen.get(cl, 0) + 1
            assert v == seen[cl]
        assert all(visits[k] == n for k, n in seen.items())
        assert x0.shape == run.model().shape


def test_declared_messages_read_in_units_of_d():
    from fedmpi.algorithms import REGISTRY, message_sizes

    assert message_sizes(REGISTRY["fedavg"]) == "down d, up d"
    assert message_sizes(REGISTRY["toy_probe"]) == "train: down 2d, up d + 2; refine: down d, up d"


def _initial(c):
    """x^0 as the runtime builds it (seeded model init)."""
    import torch
    from fedmpi.flat import FlatModel
    from fedmpi.models import build_model
    from fedmpi.runtime.rng import key_seed

    torch.manual_seed(key_seed(c.seed, "init"))
    m = build_model(c.model.name, 1, 10, 16, **c.model.options)
    return FlatModel(m).params.detach().numpy()
