"""The small frictions of a first session with the command line: `--set KEY VALUE` with a
space, a key in the wrong section or misspelt, a misspelt preset, algorithm, dataset or
model, `fedmpi presets` without a word of what each is, `fedmpi watch` of a file that a
queued job has yet to write, and a model too large for the images without the ones that fit."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, fedmpi
from helpers import write_config

from fedmpi.config import presets, resolve
from fedmpi.errors import UsageError, did_you_mean
from fedmpi.models import build_model, check_options

SPACED = "fedmpi: --set train.lr: expected KEY=VALUE; did you mean --set train.lr=0.1?\n"


@pytest.mark.parametrize("args", [
    ["run", "--set", "train.lr", "0.1"],                  # click took 0.1 for the config file
    ["run", "--set", "train.lr=", "0.1"],
    ["run", "CONFIG", "--set", "train.lr", "0.1"],        # ... for an extra argument
    ["config", "--set", "train.lr", "0.1"],
    ["partition", "--set", "train.lr", "0.1"],
    ["sweep", "--set", "train.lr", "0.1"],                # ... for the sweep file
    ["sweep", "CONFIG", "--set", "train.lr", "0.1"],
])
def test_set_with_a_space_for_the_equals_sign_says_what_was_meant(tmp_path, args):
    config = write_config(tmp_path / "exp.toml")
    proc = fedmpi([config if a == "CONFIG" else a for a in args], cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, SPACED)
    assert sorted(os.listdir(tmp_path)) == ["exp.toml"]   # no results file


def test_evaluate_set_with_a_space_says_what_was_meant():
    results = ROOT / "tests" / "data" / "results-v1.h5"   # the file: not taken for the value
    proc = fedmpi(["evaluate", results, "--set", "eval.linear_epochs", "5"])
    assert (proc.returncode, proc.stderr) == (
        2, "fedmpi: --set eval.linear_epochs: expected KEY=VALUE; did you mean "
           "--set eval.linear_epochs=5?\n")


def test_a_config_file_after_a_bare_set_is_not_taken_for_its_value(tmp_path):
    config = write_config(tmp_path / "exp.toml")
    proc = fedmpi(["config", "--set", "train.lr", config])
    assert (proc.returncode, proc.stderr) == (
        2, "fedmpi: --set 'train.lr': expected KEY=VALUE, e.g. --set train.lr=0.1\n")


@pytest.mark.parametrize("override, says", [
    ("lr=0.1", "config field lr: unknown key (did you mean 'train.lr'?); allowed: algorithm, "),
    ("train.lrr=0.1", "config field train.lrr: unknown key (did you mean 'train.lr'?); allowed: "),
    ("eval.lr=0.1", "config field eval.lr: unknown key (did you mean 'train.lr'?); allowed: "),
    ("train.seed=1", "config field train.seed: unknown key (did you mean 'seed'?); allowed: "),
    ("batch_size=8", "config field batch_size: unknown key (did you mean 'eval.batch_size' or "
                     "'train.batch_size'?); allowed: "),
    ("trian.lr=0.1", "config field trian: unknown key (did you mean 'train'?); allowed: "),
    ("train.xyz=1", "config field train.xyz: unknown key; allowed: adam_betas, "),   # nothing close
    ("algorithm.name=fedavgg", "config field algorithm.name: 'fedavgg' is not allowed (did you mean "
                               "'fedavg'?); choose one of "),
    ("algorithm.lr=0.1", "config field algorithm.lr: fedavg has no such parameter (did you mean "
                         "'train.lr'?); allowed: none"),
    ("data.dataset=mnist5", "config field data.dataset: 'mnist5' is not allowed (did you mean "
                            "'mnist5k'?); choose one of "),
    ("model.name=cnnn", "model.name must be one of 'cnn', 'resnet18', 'vgg11', 'lstm', '2nn', 'mlp', "
                        "got 'cnnn' (did you mean 'cnn'?)"),
    ("model.hiden=8", "model.hiden is not an option of model 'cnn' (did you mean 'hidden'?); "
                      "allowed: hidden, channels, padding, norm, proj_dim"),
])
def test_an_unknown_key_or_name_gets_the_one_meant(override, says):
    with pytest.raises(UsageError) as caught:
        resolve(None, "default", [override])
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)


def test_a_misspelt_preset_or_algorithm_gets_the_one_meant():
    with pytest.raises(UsageError, match=r"^preset 'defualt' does not exist \(did you mean "
                                         r"'default'\?\); available: default, "):
        resolve(None, "defualt")
    proc = fedmpi(["algorithms", "fedavgg"])
    assert proc.returncode == 2 and proc.stderr.startswith(
        "fedmpi: algorithm 'fedavgg' does not exist (did you mean 'fedavg'?); choose from ")
    assert check_options("cnn", {"proj_dim": 0})   # a known option still passes


def test_did_you_mean():
    assert did_you_mean("defualt", ["default", "fedacg_fmnist"]) == " (did you mean 'default'?)"
    assert did_you_mean("Default", ["default"]) == " (did you mean 'default'?)"
    assert did_you_mean("x.c", ["a.c", "b.c", "d.c", "e.c"]) == " (did you mean 'a.c', 'b.c' or 'd.c'?)"
    assert did_you_mean("zzz", ["default"]) == ""
    # a file name: its dot is no section, so every .h5 file is not "the same key"
    assert did_you_mean("lvie.h5", ["live.h5", "other.h5"], dotted=False) == " (did you mean 'live.h5'?)"


def test_presets_lists_each_with_its_description():
    proc = fedmpi(["presets"], check=True)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == presets()
    width = max(map(len, presets()))
    for name, line in zip(presets(), lines):
        first = (ROOT / "fedmpi" / "presets" / f"{name}.toml").read_text().splitlines()[0]
        assert first.startswith("# ") and line == f"{name:<{width}}  {first[2:]}", name
        assert len(first) <= 90, f"{name}: the description is one short line"
    assert lines[0].startswith("default                FedAvg on MNIST-5k")


def _watch(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedmpi", "watch", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_watch_waits_for_a_file_that_does_not_exist_yet(tmp_path):
    path = tmp_path / "queued" / "run.h5"   # the run makes its folder too
    watcher = _watch(path, "--interval", "0.2", "--timeout", "60")
    waiting = watcher.stderr.readline()
    assert waiting == f"fedmpi: waiting for {path} to appear...\n"
    # a job that starts later: a completed results file moved into place
    source = ROOT / "tests" / "data" / "results-v1.h5"
    writer = subprocess.Popen(["sh", "-c", f"sleep 0.5 && mkdir {path.parent} && cp {source} "
                                           f"{path}.tmp && mv {path}.tmp {path}"])
    stdout, stderr = watcher.communicate(timeout=60)
    assert writer.wait(timeout=10) == 0
    assert watcher.returncode == 0 and stderr == "", stderr
    lines = stdout.splitlines()
    assert lines[0] == f"watching {path}: fedavg on synthetic, 2 rounds, completed"
    assert lines[-1].startswith("completed: 2/2 rounds, final test_acc ")


def test_watch_of_a_missing_file_times_out_hints_or_refuses(tmp_path):
    shutil.copy(ROOT / "tests" / "data" / "results-v1.h5", tmp_path / "live.h5")
    typo = tmp_path / "lvie.h5"
    started = time.monotonic()
    proc = fedmpi(["watch", typo, "--timeout", "0.5", "--interval", "0.2"])
    assert time.monotonic() - started >= 0.5
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        124, f"fedmpi: waiting for {typo} to appear... (did you mean 'live.h5'?)\n",
        f"timeout: {typo} did not become readable within 0.5 s\n")
    proc = fedmpi(["watch", typo, "--once"])   # the state now: there is none
    assert (proc.returncode, proc.stderr) == (2, f"fedmpi: results file {typo} does not exist\n")
    proc = fedmpi(["watch", tmp_path / "live.h5" / "x.h5"])   # could never appear
    assert (proc.returncode, proc.stderr) == (
        2, f"fedmpi: results file {tmp_path}/live.h5/x.h5 cannot appear: {tmp_path}/live.h5 is "
           f"not a directory\n")


def test_a_model_too_large_for_the_images_names_the_models_that_fit():
    with pytest.raises(UsageError) as caught:
        build_model("cnn", 1, 10, 8)
    assert str(caught.value) == ("model.name 'cnn' needs images of at least 16x16, got 8x8; "
                                 "models for 8x8: 'resnet18', 'vgg11', '2nn'")
    for name in ("resnet18", "vgg11", "2nn"):   # and they do fit
        build_model(name, 1, 10, 8)
