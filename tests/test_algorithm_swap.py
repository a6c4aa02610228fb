"""Changing the algorithm (``--set algorithm.name``, a sweep's grid or [set]) never carries
the old algorithm's parameters into the new one by name: FedACG's proximal beta is not
FedAvgM's server momentum. Only parameters given together with the new name stay."""

import dataclasses
import itertools
import tomllib

import pytest

from fedmpi import config as cfg
from fedmpi import sweep as sweeps
from fedmpi.algorithms import REGISTRY
from fedmpi.analysis.report import summarize
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import fedmpi
from helpers import TINY, merged, write_config

NOTE = ("fedmpi: algorithm.beta = 0.01 was set for fedacg; fedavgm uses its default 0.9 "
        "(set algorithm.beta to override)")


@pytest.mark.slow
def test_fedavgm_on_the_fedacg_preset_gets_its_own_momentum_and_says_so():
    c = cfg.resolve(None, "fedacg_fmnist", ["algorithm.name=fedavgm"])
    assert c.algorithm.params == {"beta": 0.9}
    assert c.algorithm_param_sources == {"beta": "default"}
    proc = fedmpi(["config", "--preset", "fedacg_fmnist", "--set", "algorithm.name=fedavgm"], check=True)
    shown = tomllib.loads(proc.stdout)
    assert proc.returncode == 0 and shown["algorithm"] == {"name": "fedavgm", "beta": 0.9}
    assert proc.stderr.splitlines() == [NOTE]   # once; lam has no meaning for fedavgm: silent
    assert cfg.resolve(None, "fedacg_fmnist").algorithm_notes == []   # no change, no line


@pytest.mark.parametrize("order", [0, 1])
def test_a_shared_name_given_with_the_new_algorithm_is_honoured(order):
    overrides = ["algorithm.name=fedavgm", "algorithm.beta=0.5"][::1 if order == 0 else -1]
    c = cfg.resolve(None, "fedacg_fmnist", overrides)
    assert c.algorithm.params == {"beta": 0.5} and c.algorithm_notes == []
    assert c.algorithm_param_sources == {"beta": "command line"}


def test_a_sweep_over_algorithm_names_gives_each_its_defaults(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('preset = "fedacg_fmnist"\n[grid]\n"algorithm.name" = ["fedacg", "fedavgm", "fedavg"]\n')
    plan = sweeps.load(path)
    params = [plan.config(cell).algorithm.params for cell in plan.cells]
    assert params[0] == {"lam": 0.85, "beta": 0.01, "prox_form": "paper"}   # the preset's own
    assert params[1] == {"beta": 0.9} and params[2] == {}
    # a parameter the same cell gives ([set]) is honoured
    path.write_text('preset = "fedacg_fmnist"\n[set]\n"algorithm.beta" = 0.5\n'
                    '[grid]\n"algorithm.name" = ["fedacg", "fedavgm"]\n')
    plan = sweeps.load(path)
    assert [plan.config(cell).algorithm.params["beta"] for cell in plan.cells] == [0.5, 0.5]


# What some algorithms need from the rest of the config: MOON a projection head, FNR-FL a
# server-side public set.
BASE = merged(TINY, model={"proj_dim": 16}, data={"public_size": 100})
CANDIDATE_STRINGS = ("batch", "none", "layer", "repo", "paper", "code", "all_others", "fedavg",
                     "simclr", "eq5", "plain", "raw")


def _defaults(name):
    return {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(REGISTRY[name].Params)}


def _candidates(default, allowed=()):
    if isinstance(allowed, tuple) and allowed:   # declared choices (else a range, e.g. ">= 0")
        return [v for v in allowed if v != default]
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, max(default - 1, 0)]
    if isinstance(default, float):
        return [default * 0.5 if default else 0.25, default + 0.05]
    if isinstance(default, (tuple, list)) and all(isinstance(x, str) for x in default):
        return [[], ["classifier"]]   # layer names (algorithm.private)
    if isinstance(default, (tuple, list)):
        return [[x * 0.5 for x in default]]
    if isinstance(default, str):
        return [s for s in CANDIDATE_STRINGS if s != default]
    return []


def _non_default(name, key):
    """A value of ``key`` that algorithm ``name`` accepts and that is not its default."""
    default = _defaults(name)[key]
    field = next(f for f in dataclasses.fields(REGISTRY[name].Params) if f.name == key)
    for value in _candidates(default, field.metadata.get("allowed", ())):
        values = merged(BASE, algorithm={"name": name, key: value})
        try:
            got = cfg.from_dict(values).algorithm.params[key]
        except Exception:   # noqa: BLE001 - not a valid value: try the next
            continue
        if got != default:
            return value
    return None


SHARED = [(a, b, key) for a, b in itertools.permutations(sorted(REGISTRY), 2)
          for key in sorted(set(_defaults(a)) & set(_defaults(b)))]


@pytest.mark.slow
def test_every_pair_of_algorithms_that_share_a_parameter_name_is_covered(tmp_path):
    assert ("fedacg", "fedavgm", "beta") in SHARED and len(SHARED) > 20
    missing = []
    for a, b, key in SHARED:
        value = _non_default(a, key)
        if value is None:
            missing.append((a, key))
            continue
        path = write_config(tmp_path / f"{a}.toml", BASE, algorithm={"name": a, key: value})
        c = cfg.resolve(str(path), None, [f"algorithm.name={b}"])
        assert c.algorithm.name == b
        assert c.algorithm.params[key] == cfg.from_dict(merged(BASE, algorithm={"name": b})).algorithm.params[key], (a, b, key)
        assert c.algorithm_param_sources[key] == "default", (a, b, key)
        assert any(note.startswith(f"algorithm.{key} = ") and f"was set for {a}; {b} uses its default"
                   in note for note in c.algorithm_notes), (a, b, key, c.algorithm_notes)
    assert not missing, f"no valid non-default value found for {missing}; extend _candidates"


def test_fnrfl_base_params_belong_to_their_base(tmp_path):
    path = write_config(tmp_path / "f.toml", BASE, algorithm={
        "name": "fnrfl", "base": "fedacg", "base_params": {"beta": 0.05}})
    assert cfg.resolve(str(path)).algorithm.params["base_params"]["beta"] == 0.05
    c = cfg.resolve(str(path), None, ["algorithm.base=fedavgm"])
    assert c.algorithm.params["base_params"] == {"beta": 0.9}
    assert c.algorithm_param_sources["base_params"] == "default"
    assert any("algorithm.base_params = " in n and "base fedacg; fedavgm" in n for n in c.algorithm_notes)
    c = cfg.resolve(str(path), None, ["algorithm.base=fedavgm", "algorithm.base_params.beta=0.7"])
    assert c.algorithm.params["base_params"] == {"beta": 0.7}
    # the FNR-FL presets: a new base gets its defaults, FNR-FL's own lam is no base parameter
    c = cfg.resolve(None, "fnrfl_fmnist", ["algorithm.base=fedacg"])
    assert c.algorithm.params["base_params"] == {"lam": 0.85, "beta": 0.01, "prox_form": "paper"}
    assert c.algorithm.params["lam"] == 1.0


def test_sources_are_recorded_and_reported_and_resume_keeps_the_stored_parameters(tmp_path):
    path = write_config(tmp_path / "c.toml", TINY, rounds=1, output=str(tmp_path / "run.h5"),
                        algorithm={"name": "fedacg", "beta": 0.02})
    c = cfg.resolve(str(path), None, ["algorithm.lam=0.8"])
    assert c.algorithm_param_sources == {"lam": "command line", "beta": "config file",
                                         "prox_form": "default"}
    run_experiment(c, LocalComm(), quiet=True)
    with RunFile(c.output_path()) as run:
        assert run.attrs["algorithm_param_sources"] == c.algorithm_param_sources
        stored = run.config
    text = summarize(c.output_path())
    assert "beta=0.02 (config file), lam=0.8 (command line), prox_form=paper (default)" in text
    # --resume builds the config from the stored one: its parameters stay as they were
    again = cfg.from_dict(dict(stored, output=str(c.output_path())))
    assert again.algorithm.name == "fedacg" and again.algorithm.params == c.algorithm.params
    # an old file (no sources attribute) summarizes without the line
    from test_report import write_run
    write_run(tmp_path / "old.h5")
    assert "parameters" not in summarize(tmp_path / "old.h5")
