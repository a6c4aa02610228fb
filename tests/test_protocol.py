"""The protocol carries extra payloads, client state, gathered scalars, two phases and
server state: a toy algorithm with a closed-form answer, through the real runtime."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

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


# ---- parameter ranges: declared on the field, checked by the base Params ----------------

@pytest.mark.parametrize("allowed, good, bad, message", [
    ("[0, 1)", [0, 0.5], [1.0, -0.1, float("nan")], "must be in [0, 1), got 1.0"),
    ("(0, inf)", [1e-9, 1e300], [0.0, float("inf")], "must be in (0, inf), got 0.0"),
    ("> 0", [1e-9, float("inf")], [0.0, -1.0], "must be > 0, got 0.0"),
    (">= 1", [1, 7], [0, "x", True], "must be >= 1, got 0"),
    (("a", "b"), ["a", "b"], ["c", 1], "'c' is not allowed; choose one of a, b"),
])
def test_param_ranges_check_with_one_message_style(allowed, good, bad, message):
    from fedmpi.algorithms.params import check_param
    from fedmpi.errors import UsageError

    for value in good:
        check_param("x", value, allowed)
    for value in bad:
        with pytest.raises(UsageError, match=r"^config field algorithm\.x: "):
            check_param("x", value, allowed)
    with pytest.raises(UsageError) as err:
        check_param("x", bad[0], allowed)
    assert str(err.value) == f"config field algorithm.x: {message}"


def test_params_fields_are_checked_at_construction_and_in_subclasses():
    from fedmpi.algorithms.params import Params, param
    from fedmpi.errors import UsageError

    @dataclass(frozen=True)
    class Base(Params):
        k: int = param(2, ">= 1", "an integer")

    @dataclass(frozen=True)
    class Child(Base):
        f: float = param(0.5, "[0, 1]", "a fraction")
        free: float = param(-3.0, doc="anything")

        def __post_init__(self):
            super().__post_init__()
            if self.k > 5:
                raise UsageError("k too big")

    assert Child().free == -3.0
    with pytest.raises(UsageError, match="algorithm.k: must be an integer >= 1, got 1.5"):
        Child(k=1.5)
    with pytest.raises(UsageError, match=r"algorithm.f: must be in \[0, 1\], got 2"):
        Child(f=2)
    with pytest.raises(UsageError, match="k too big"):
        Child(k=6)


# ---- the optional parts of the protocol ---------------------------------------------------

def test_declarations_take_the_phase_and_default_to_every_phase():
    from fedmpi.algorithms import REGISTRY

    for name, cls in REGISTRY.items():
        alg = cls()
        for phase in cls.phases:
            assert set(alg.contribution_sizes(10, phase)) <= set(alg.contribution_sizes(10)), name
            assert set(alg.gather_sizes(10, phase)) <= set(alg.gather_sizes(10)), name


def test_gram_and_self_supervised_hooks_live_in_mixins():
    from fedmpi.algorithms import REGISTRY, Algorithm
    from fedmpi.algorithms.mixins import GramAggregation, SelfSupervised

    assert not hasattr(Algorithm, "gram_coefficients")
    assert Algorithm.supervised and not Algorithm().gram_weighted("train")   # what the runtime reads
    for name, cls in REGISTRY.items():
        assert cls.supervised == (not issubclass(cls, SelfSupervised)), name
        if cls().gram_weighted(cls.phases[0]):
            assert issubclass(cls, GramAggregation), name
    assert issubclass(REGISTRY["fedu2"], GramAggregation)


def test_count_once_makes_the_plain_mean_of_fedmim_and_scaffold_bitwise():
    """Weight 1 per client: x += (eta_g / sum of weights) sum_i Delta_i is the same bits as
    the former x += (eta_g / S) sum_i Delta_i."""
    from fedmpi.algorithms import Upload, build
    from fedmpi.algorithms.base import RoundContext

    gen = torch.Generator().manual_seed(0)
    uploads = [Upload(delta=torch.randn(50, generator=gen), num_samples=3 + i, loss=0.0, steps=1,
                      extras={"delta_c": torch.randn(50, generator=gen)}) for i in range(7)]
    ctx = RoundContext(round=0, phase="train", lr=0.1, lr_prev=0.1, global_lr=0.7, weight_decay=0.0,
                       grad_clip=0.0, local_epochs=1, batch_size=1, num_clients=10,
                       participants=tuple(range(7)), seed=0)
    for name in ("fedmim", "scaffold"):
        alg = build(name, {})
        x = torch.randn(50, generator=gen)
        state = alg.init_server_state(x)
        parts = [alg.contribution(u) for u in uploads]
        sums = {k: torch.zeros_like(parts[0][k]) for k in parts[0]}
        for part in parts:
            for k in sums:
                sums[k] += part[k]
        assert set(sums) == set(alg.contribution_sizes(50))
        alg.server_update(state, sums, {"client": np.arange(7)}, ctx)
        assert torch.equal(state["x"], x.clone().add_(sums["delta"], alpha=0.7 / 7)), name
