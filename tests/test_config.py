import pytest

from fedmpi import config as cfg
from fedmpi.errors import UsageError


def test_default_preset_resolves():
    c = cfg.resolve()
    assert c.name == "default" and c.algorithm.name == "fedavg"
    assert c.data.dataset == "mnist5k"
    assert str(c.output_path()) == f"runs/default-fedavg-seed0-{c.digest()}.h5"


def test_overrides_take_precedence_and_are_typed():
    c = cfg.resolve(overrides=["train.lr=0.2", "rounds=3", "data.dataset=synthetic",
                               "algorithm.name=fedprox", "algorithm.mu=0.5", "model.hidden=64",
                               "system.deterministic=true"])
    assert c.train.lr == 0.2 and c.rounds == 3 and c.data.dataset == "synthetic"
    assert c.algorithm.params == {"mu": 0.5}
    assert c.model.options == {"hidden": 64, "channels": (32, 64), "padding": "valid",
                               "norm": "none"}  # defaults filled in
    assert c.system.deterministic is True


def test_file_and_round_trip_through_toml(tmp_path):
    c = cfg.resolve(overrides=["algorithm.name=fedprox", "algorithm.mu=0.1", "seed=7"])
    path = tmp_path / "exp.toml"
    path.write_text(cfg.to_toml(c.to_dict()))
    again = cfg.resolve(str(path))
    assert again.to_dict() == c.to_dict()


def test_ints_are_accepted_for_floats():
    assert cfg.resolve(overrides=["train.lr=1"]).train.lr == 1.0


BAD = [
    (["train.lr=-0.1"], "train.lr"),
    (["train.lr=fast"], "train.lr"),
    (["rounds=0"], "rounds"),
    (["rounds=2.5"], "rounds"),
    (["clients.per_round=50"], "clients.per_round"),
    (["clients.num=0"], "clients.num"),
    (["partition.kind=zipf"], "partition.kind"),
    (["partition.alpha=0"], "partition.alpha"),
    (["data.dataset=imagenet22k"], "data.dataset"),
    (["algorithm.name=fedfoo"], "algorithm.name"),
    (["algorithm.mu=0.1"], "algorithm.mu"),           # fedavg has no mu
    (["algorithm.name=fedprox", "algorithm.mu=big"], "algorithm.mu"),
    (["algorithm.name=fedprox", "algorithm.mu=-1"], "algorithm.mu"),
    (["model.name=transformer"], "model.name"),
    (["algorithm.name=moon"], "model.proj_dim"),       # MOON needs a projection head
    (["model.hidden=-3"], "model.hidden"),
    (["system.device=tpu"], "system.device"),
    (["system.deterministic=1"], "system.deterministic"),
    (["train.batch_size=0"], "train.batch_size"),
    (["eval.every=0"], "eval.every"),
    (["optimiser=adam"], "optimiser"),
    (["train.momentum=1.5"], "train.momentum"),
    (["train.optimiser=adam"], "train.optimiser"),    # an unknown key in a fixed section
    (["output=runs/{nme}.h5"], "output"),
    (["seed=-1"], "seed"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_names_the_field_on_one_line(overrides, field):
    with pytest.raises(UsageError) as err:
        cfg.resolve(overrides=overrides)
    message = str(err.value)
    assert field in message and "\n" not in message


def test_bad_sources():
    with pytest.raises(UsageError, match="does not exist"):
        cfg.resolve("/nonexistent/exp.toml")
    with pytest.raises(UsageError, match="preset 'nope'"):
        cfg.resolve(preset="nope")
    with pytest.raises(UsageError, match="KEY=VALUE"):
        cfg.resolve(overrides=["train.lr"])
    with pytest.raises(UsageError, match="not both"):
        cfg.resolve("x.toml", "default")


def test_invalid_toml_is_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("rounds = = 3\n")
    with pytest.raises(UsageError) as err:
        cfg.resolve(str(path))
    assert "not valid TOML" in str(err.value) and str(path) in str(err.value)


def test_section_given_as_value(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('train = 3\n')
    with pytest.raises(UsageError, match="train"):
        cfg.resolve(str(path))


def test_changing_a_selector_on_the_command_line_drops_the_old_choices_parameters():
    """--set partition.kind=... on a Dirichlet preset must not trip over its alpha; the
    same for algorithm parameters; parameters given on the command line stay."""
    c = cfg.resolve(None, "default", ["partition.kind=pathological", "partition.n=3"])
    assert c.partition.kind == "pathological" and c.partition.params == {"n": 3, "min_size": 1}
    c = cfg.resolve(None, "fedmrur_fmnist", ["algorithm.name=fedprox", "algorithm.mu=0.1"])
    assert c.algorithm.name == "fedprox" and c.algorithm.params["mu"] == 0.1
    assert "rho" not in c.algorithm.params
    same = cfg.resolve(None, "fedmrur_fmnist", ["algorithm.name=fedmrur"])
    assert same.algorithm.params == cfg.resolve(None, "fedmrur_fmnist").algorithm.params
    # not even what the new algorithm takes by the same name (tests/test_algorithm_swap.py):
    # the preset's heads give way to the new method's defaults unless given with it
    preset = cfg.load_preset("fussl_fmnist_silo")["algorithm"]
    for name in ("fedsimclr", "fedsimsiam", "fedu", "fedema", "fedu2"):
        c = cfg.resolve(None, "fussl_fmnist_silo", [f"algorithm.name={name}"])
        assert preset["proj_dim"] == 128 and c.algorithm.params["proj_dim"] == 512
        assert any(n.startswith("algorithm.proj_dim = 128 was set for fedbyol") for n in c.algorithm_notes)
        c = cfg.resolve(None, "fussl_fmnist_silo", [f"algorithm.name={name}", "algorithm.proj_dim=128"])
        assert c.algorithm.params["proj_dim"] == 128
    assert "pred_hidden" not in cfg.resolve(None, "fussl_fmnist_silo",
                                            ["algorithm.name=fedsimclr"]).algorithm.params
    with pytest.raises(UsageError, match="model.name 'cnn' is an image model"):
        cfg.resolve(None, "default", ["data.dataset=shakespeare"])
    with pytest.raises(UsageError, match="data.augment"):
        cfg.resolve(None, "default", ["data.dataset=shakespeare", "model.name=lstm", "data.augment=true"])
