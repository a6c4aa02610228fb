"""Hostile config input: binary or unreadable config files, NaN and infinity, integers
past what int64 code takes, names and paths a file system cannot hold, broken plugins.

Each is one line on stderr that names the field (or the path) and what is allowed, exit
code 2, raised while the config is resolved: before any MPI work and before the results
file is touched. docs/hostile-inputs.md lists every case with the test that proves it.
"""

import os

import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi.errors import UsageError

from conftest import fedmpi
from helpers import TINY, write_config

BIG = 10 ** 23          # the bug report's seed: past int64 and uint64
HUGE = 10 ** 400        # past a float64 too


def assert_usage_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmpi: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def refused(overrides=(), path=None) -> str:
    """The one-line UsageError message that resolving the config raises."""
    with pytest.raises(UsageError) as err:
        cfg.resolve(str(path) if path else None, None, list(overrides))
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# ---- config files that are not TOML text (through the real command line) ----------------

def test_binary_config_file_is_one_line(tmp_path):
    """200 random bytes and a PNG were a UnicodeDecodeError traceback."""
    noise = tmp_path / "noise.toml"
    noise.write_bytes(bytes([0xF3, 0x28]) + os.urandom(198))
    assert_usage_error(fedmpi(["config", str(noise)]),
                       f"config file {noise} is not a TOML text file", "not UTF-8")
    png = tmp_path / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    out = tmp_path / "x.h5"
    assert_usage_error(fedmpi(["run", str(png), "-o", str(out)]),
                       f"config file {png} is not a TOML text file", "byte 0x89 at offset 0")
    assert not out.exists()


def test_binary_or_directory_sweep_file_is_one_line(tmp_path):
    """`fedmpi sweep noise.toml` was a UnicodeDecodeError traceback, a directory click's
    multi-line usage message."""
    noise = tmp_path / "noise.toml"
    noise.write_bytes(bytes([0xF3, 0x28]) + os.urandom(198))
    assert_usage_error(fedmpi(["sweep", str(noise)]),
                       f"sweep file {noise} is not a TOML text file", "not UTF-8")
    assert_usage_error(fedmpi(["sweep", str(tmp_path)]), f"sweep file {tmp_path} is a directory")


def test_config_file_with_nul_bytes_or_a_results_file(tmp_path):
    """UTF-8 that holds NUL bytes is binary too (TOML forbids them); so is an HDF5 file."""
    nul = tmp_path / "nul.toml"
    nul.write_bytes(b"rounds = 3\n\x00\x00\x00\n")
    assert "not a TOML text file (NUL byte at offset 11)" in refused(path=nul)
    h5 = tmp_path / "run.h5"
    h5.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(1000))
    assert f"config file {h5} is not a TOML text file" in refused(path=h5)


def test_config_file_that_is_a_directory(tmp_path):
    """`fedmpi config DIR` and `fedmpi run DIR`: one line that names the path."""
    folder = tmp_path / "configs"
    folder.mkdir()
    assert_usage_error(fedmpi(["config", str(folder)]), f"config file {folder} is a directory")
    out = tmp_path / "x.h5"
    assert_usage_error(fedmpi(["run", str(folder), "-o", str(out)]),
                       f"config file {folder} is a directory")
    assert not out.exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root reads a chmod 000 file regardless")
def test_unreadable_config_file(tmp_path):
    locked = write_config(tmp_path / "locked.toml")
    locked.chmod(0)
    try:
        assert_usage_error(fedmpi(["config", str(locked)]),
                           f"config file {locked} cannot be read", "Permission denied")
    finally:
        locked.chmod(0o644)


def test_config_file_with_a_byte_order_mark_is_read(tmp_path):
    """Editors on Windows save UTF-8 with a BOM; the file is still the config it shows."""
    path = write_config(tmp_path / "bom.toml")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert cfg.resolve(str(path)).to_dict() == cfg.from_dict(dict(TINY)).to_dict()


def test_config_nested_too_deeply(tmp_path):
    """tomllib recurses per nesting level: a RecursionError traceback before."""
    deep = "[" * 5000 + "]" * 5000
    path = tmp_path / "deep.toml"
    path.write_text(f"rounds = {deep}\n")
    assert "not valid TOML (arrays or tables nested too deeply)" in refused(path=path)
    assert "model.hidden=...: value nested too deeply" in refused([f"model.hidden={deep}"])


def test_config_file_too_big_to_be_a_config(tmp_path):
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * cfg.CONFIG_MAX_BYTES + b"\n")
    assert "is not a TOML text file (more than 16 MiB)" in refused(path=big)


# ---- NaN and infinity --------------------------------------------------------------------

def test_nan_learning_rate_on_the_command_line_exits_2_before_the_results_file(tmp_path):
    """`--set train.lr=nan` used to run a full round first."""
    out = tmp_path / "x.h5"
    config = write_config(tmp_path / "c.toml")
    assert_usage_error(fedmpi(["run", str(config), "--set", "train.lr=nan", "-o", str(out)]),
                       "config field train.lr: must be a finite number, got nan")
    assert not out.exists()


def test_nan_and_inf_in_a_config_file(tmp_path):
    path = tmp_path / "c.toml"
    for text, field in (("[train]\nlr = nan\n", "train.lr"), ("[train]\nlr = inf\n", "train.lr"),
                        ("[partition]\nnoise = -inf\n", "partition.noise"),
                        ("[algorithm]\nname = \"fedprox\"\nmu = nan\n", "algorithm.mu")):
        path.write_text(text)
        assert f"config field {field}: must be a finite number" in refused(path=path)


NON_FINITE = [
    pytest.param("train.lr=nan", "train.lr", id="lr-nan"),
    pytest.param("train.lr=inf", "train.lr", id="lr-inf"),
    pytest.param(f"train.lr={HUGE}", "train.lr", id="lr-10**400"),
    pytest.param("train.lr_decay=inf", "train.lr_decay", id="lr_decay-inf"),
    pytest.param("train.weight_decay=inf", "train.weight_decay", id="weight_decay-inf"),
    pytest.param("train.grad_clip=inf", "train.grad_clip", id="grad_clip-inf"),
    pytest.param("train.global_lr=nan", "train.global_lr", id="global_lr-nan"),
    pytest.param("partition.noise=nan", "partition.noise", id="noise-nan"),
    pytest.param("partition.noise=inf", "partition.noise", id="noise-inf"),
    pytest.param("partition.brightness=nan", "partition.brightness", id="brightness-nan"),
    pytest.param("partition.saturation=inf", "partition.saturation", id="saturation-inf"),
    pytest.param("clients.replace_prob=nan", "clients.replace_prob", id="replace_prob-nan"),
    pytest.param("eval.finetune_fractions=[0.1, inf]", "eval.finetune_fractions",
                 id="finetune_fractions-inf"),
    pytest.param(f"eval.finetune_fractions=[{HUGE}]", "eval.finetune_fractions",
                 id="finetune_fractions-10**400"),
]


@pytest.mark.parametrize("override,field", NON_FINITE)
def test_non_finite_numbers_are_refused(override, field):
    assert f"config field {field}: must be a finite number" in refused([override])


def test_negative_infinity_is_out_of_range():
    assert "config field train.lr: must be > 0, got -inf" in refused(["train.lr=-inf"])
    assert "config field train.weight_decay: must be >= 0, got -inf" in refused(
        ["train.weight_decay=-inf"])


def test_non_finite_partition_and_model_options():
    assert "partition.alpha=nan: must be a number > 0" in refused(["partition.alpha=nan"])
    assert "partition.alpha=inf: must be a number > 0" in refused(["partition.alpha=inf"])
    assert "partition.quantity_alpha=nan" in refused(["partition.quantity_alpha=nan"])
    assert "model.dropout must be a number in [0, 1), got nan" in refused(
        ["model.name=vgg11", "model.dropout=nan"])


def test_non_finite_algorithm_parameters_name_the_one_that_takes_inf():
    """Every algorithm parameter must be finite except FedU's mu, where infinity means
    'always the global predictor' (FedBYOL); the message of the others says so."""
    for value in ("nan", "inf", "-inf", str(HUGE)):
        message = refused(["algorithm.name=fedprox", f"algorithm.mu={value}"])
        assert message.startswith("config field algorithm.mu: must be a finite number")
        if value != str(HUGE):
            assert "inf only for fedu's algorithm.mu" in message
    fedu = cfg.resolve(overrides=["algorithm.name=fedu", "algorithm.mu=inf"])
    assert fedu.algorithm.params["mu"] == float("inf")
    assert "algorithm.mu: must be a number (inf allowed), got nan" in refused(
        ["algorithm.name=fedu", "algorithm.mu=nan"])


def test_non_finite_inside_list_and_table_parameters():
    assert "config field algorithm.alpha: must be a finite number, got nan" in refused(
        ["algorithm.name=fedmim", "algorithm.alpha=[nan, 0.1]"])
    assert "algorithm.base_params: algorithm.mu: must be a finite number" in refused(
        ["algorithm.name=fnrfl", "algorithm.base=fedprox", "algorithm.base_params={mu = nan}"])


def test_fedu_infinite_mu_round_trips_through_toml(tmp_path):
    c = cfg.resolve(overrides=["algorithm.name=fedu", "algorithm.mu=inf"])
    path = tmp_path / "fedu.toml"
    path.write_text(cfg.to_toml(c.to_dict()))
    assert cfg.resolve(str(path)).algorithm.params["mu"] == float("inf")


# ---- integers past what int64 code takes -----------------------------------------------

def test_huge_seed_exits_2_before_the_results_file(tmp_path):
    """seed = 10**23 passed validation and crashed after the results file was created."""
    out = tmp_path / "x.h5"
    config = write_config(tmp_path / "c.toml")
    assert_usage_error(fedmpi(["run", str(config), "--set", f"seed={BIG}", "-o", str(out)]),
                       "config field seed: must be an integer in [0, 2**64 - 1] = "
                       "[0, 18446744073709551615]")
    assert not out.exists()


def test_seed_range_ends_at_2_64_minus_1():
    assert cfg.resolve(overrides=[f"seed={2 ** 64 - 1}"]).seed == 2 ** 64 - 1
    assert "[0, 18446744073709551615], got 18446744073709551616" in refused([f"seed={2 ** 64}"])
    assert "[0, 18446744073709551615], got -1" in refused(["seed=-1"])


def test_largest_seed_runs_to_the_end(tmp_path):
    """2**64 - 1 reaches every consumer of the seed: numpy SeedSequence, the torch seeds
    derived from it, the results file's seed attribute."""
    from fedmpi.results import RunFile

    out = tmp_path / "s.h5"
    config = write_config(tmp_path / "c.toml", rounds=1, seed=2 ** 64 - 1)
    fedmpi(["run", "-q", str(config), "-o", str(out)], check=True)
    with RunFile(out) as run:
        assert run.status == "completed" and int(run.attrs["seed"]) == 2 ** 64 - 1


HUGE_INTS = ["rounds", "clients.num", "train.local_epochs", "train.batch_size", "eval.every",
             "eval.batch_size", "eval.probe_every", "eval.linear_epochs", "eval.finetune_epochs",
             "system.state_memory_mb", "system.checkpoint_every", "data.public_size",
             "clients.replace_every"]


@pytest.mark.parametrize("field", HUGE_INTS)
def test_integers_past_2_62_are_refused(field):
    extra = ["clients.per_round=1"] if field == "clients.num" else []
    message = refused(extra + [f"{field}={BIG}"])
    assert f"config field {field}: must be at most 2**62 = 4611686018427387904, got {BIG}" in message


def test_integers_up_to_2_62_are_accepted():
    assert cfg.resolve(overrides=[f"rounds={2 ** 62}"]).rounds == 2 ** 62
    assert "must be at most 2**62" in refused([f"rounds={2 ** 62 + 1}"])


def test_threads_and_crop_padding_have_their_own_caps():
    """torch.set_num_threads takes a C int (2**62 was a ValueError, 100000 threads crash
    start-up); crop_padding 2**62 overflowed int64 in the padded image's size."""
    assert "system.threads: must be at most 1024" in refused(["system.threads=100000"])
    assert "system.threads: must be at most 1024" in refused([f"system.threads={BIG}"])
    assert cfg.resolve(overrides=["system.threads=1024"]).system.threads == 1024
    assert "data.crop_padding: must be at most 1024" in refused([f"data.crop_padding={2 ** 62}"])


def test_huge_integers_in_open_sections():
    assert "config field model.hidden: must be at most 2**62" in refused([f"model.hidden={BIG}"])
    assert "config field model.channels: must be at most 2**62" in refused(
        [f"model.channels=[{BIG}, 1]"])
    assert "config field partition.min_size: must be at most 2**62" in refused(
        [f"partition.min_size={BIG}"])
    assert "config field algorithm.J: must be at most 2**62" in refused(
        ["algorithm.name=fedmim", f"algorithm.J={BIG}"])
    assert "config field algorithm.mu: must be a finite number" in refused(
        ["algorithm.name=fedprox", f"algorithm.mu={HUGE}"])


# ---- dataset options are checked at config time ----------------------------------------

SYNTHETIC = ["data.dataset=synthetic"]
SHAKESPEARE = ["data.dataset=shakespeare", "model.name=lstm", "partition.kind=natural"]


@pytest.mark.parametrize("overrides,words", [
    pytest.param(SYNTHETIC + ["data.num_train=-5"],
                 "config field data.num_train: must be an integer >= 1, got -5", id="negative"),
    pytest.param(SYNTHETIC + ["data.num_train=0"],
                 "config field data.num_train: must be an integer >= 1, got 0", id="zero"),
    pytest.param(SYNTHETIC + ["data.num_train=nan"],
                 "config field data.num_train: must be an integer >= 1, got nan", id="nan"),
    pytest.param(SYNTHETIC + ['data.num_train="many"'],
                 "config field data.num_train: must be an integer >= 1, got 'many'", id="string"),
    pytest.param(SYNTHETIC + ["data.size=2.5"],
                 "config field data.size: must be an integer >= 1, got 2.5", id="float"),
    pytest.param(SYNTHETIC + ["data.num_classes=1"],
                 "config field data.num_classes: must be an integer >= 2, got 1", id="one-class"),
    pytest.param(SYNTHETIC + [f"data.num_test={BIG}"],
                 "config field data.num_test: must be at most 2**62", id="huge"),
    pytest.param(SHAKESPEARE + ["data.test_fraction=nan"],
                 "config field data.test_fraction: must be a finite number", id="fraction-nan"),
    pytest.param(SHAKESPEARE + ['data.seq_len="80"'],
                 "config field data.seq_len: must be an integer >= 1", id="seq_len-string"),
    pytest.param(["data.dataset=tiny_imagenet", "data.cache_dir=3"],
                 "config field data.cache_dir: expected a string (a folder path), got 3",
                 id="cache_dir-number"),
])
def test_dataset_options_are_checked_before_mpi(overrides, words):
    """They were checked only when the dataset loaded, after MPI start-up."""
    assert words in refused(overrides)


# ---- names, paths, placeholders, plugins ---------------------------------------------------

@pytest.mark.parametrize("overrides,words", [
    pytest.param(['name=""'], "config field name: must not be empty", id="name-empty"),
    pytest.param(["name=a/b"], "config field name: must not contain '/'", id="name-slash"),
    pytest.param(['name="a\\nb"'], "config field name: must not contain control characters",
                 id="name-newline"),
    pytest.param(['name="a\\u0000b"'], "config field name: must not contain control characters",
                 id="name-nul"),
    pytest.param([f"name={'n' * 300}"], "config field output: file name nnnn", id="name-too-long"),
    pytest.param([f"output={'n' * 250}.h5"], "bytes; with the hidden files fedmpi keeps beside "
                 "it (.NAME.HOST.PID.tmp) a file system takes at most", id="name-no-room-beside"),
    pytest.param(["output=" + "/".join(["d" * 200] * 21) + "/x.h5"],
                 "bytes as an absolute path; with the hidden files fedmpi keeps beside it the "
                 "kernel takes at most", id="output-path-too-long"),
    pytest.param(['output=""'], "config field output: must not be empty", id="output-empty"),
    pytest.param(["output=runs/{nam}.h5"], "config field output: bad placeholder 'nam'",
                 id="output-unknown"),
    pytest.param(["output=runs/{.h5"], "config field output: bad placeholder expected '}'",
                 id="output-open-brace"),
    pytest.param(["output=runs/}.h5"], "config field output: bad placeholder Single '}'",
                 id="output-close-brace"),
    pytest.param(["output=runs/{0}.h5"], "config field output: bad placeholder Replacement index",
                 id="output-positional"),
    pytest.param(["output=runs/{name.x}.h5"],
                 "config field output: bad placeholder 'str' object has no attribute",
                 id="output-attribute"),
    pytest.param(["output=runs/{seed[0]}.h5"],
                 "config field output: bad placeholder 'int' object is not subscriptable",
                 id="output-index"),
    pytest.param(["output=runs/{seed:q}.h5"],
                 "config field output: bad placeholder Unknown format code", id="output-format-spec"),
    pytest.param(["output=runs/"], "config field output: 'runs/' names a directory",
                 id="output-dir"),
    pytest.param(["output=runs/.."], "config field output: 'runs/..' names a directory",
                 id="output-dotdot"),
    pytest.param(['output="runs/a\\u0000b.h5"'],
                 "config field output: must not contain control characters", id="output-nul"),
    pytest.param(["output=r\udcff.h5"], "config field output: must be UTF-8 text (the results "
                 "file stores it as such), got 'r\\udcff.h5'", id="output-not-utf8"),
    pytest.param(["data.data_dir=/data/\udcfe"], "config field data.data_dir: must be UTF-8 text",
                 id="data_dir-not-utf8"),
    pytest.param(['data.data_dir="data\\u0000"'],
                 "config field data.data_dir: must not contain control characters",
                 id="data_dir-nul"),
    pytest.param(['plugins=["no_such_mod"]'], "config field plugins: cannot import 'no_such_mod'",
                 id="plugin-missing"),
    pytest.param(['plugins=[""]'],
                 "config field plugins: cannot import '' (ValueError: Empty module name)",
                 id="plugin-empty"),
    pytest.param(['plugins=[".rel"]'], "config field plugins: cannot import '.rel' (TypeError",
                 id="plugin-relative"),
    pytest.param(['plugins="os"'], "config field plugins: expected a list of strings",
                 id="plugins-string"),
])
def test_names_paths_and_plugins(overrides, words):
    assert words in refused(overrides)


def test_state_dir_that_is_a_file(tmp_path):
    """Client state spills there mid-run: a FileExistsError hours in, before."""
    existing = tmp_path / "notes.txt"
    existing.write_text("x")
    message = refused([f"system.state_dir={existing}"])
    assert f"config field system.state_dir: {existing} exists and is not a directory" in message


@pytest.mark.parametrize("value", ["''", '""', ""])
def test_an_empty_data_dir_or_state_dir_is_unset(tmp_path, monkeypatch, value):
    """TOML has no null, so an empty value is how a preset's folder is cleared
    (tools/preset_fingerprints.py switches presets to synthetic data so). It read as the
    working directory: fashion_mnist looked for its files in `.` and client states spilled
    into it. Empty now means unset, on the command line and in a file."""
    from fedmpi.runtime.state import ClientStateStore

    monkeypatch.chdir(tmp_path)
    config = cfg.resolve(None, "default", [f"data.data_dir={value}", f"system.state_dir={value}"])
    assert config.data.data_dir is None and config.system.state_dir is None
    path = write_config(tmp_path / "t.toml", data={"data_dir": ""}, system={"state_dir": ""})
    config = cfg.resolve(str(path), None, [])
    assert config.data.data_dir is None and config.system.state_dir is None
    store = ClientStateStore({"c": 4}, memory_bytes=0, directory=config.system.state_dir)
    store.put(0, {"c": np.ones(4, dtype=np.float32)})
    assert list(tmp_path.iterdir()) == [path]   # spilled to the system's temporary folder
    store.close()


def test_a_tilde_in_output_outdir_and_state_dir_is_the_home_folder(tmp_path, monkeypatch):
    """A TOML file has no shell to expand ``~``, and data paths expanded it while output
    did not: ``output = "~/runs/{name}.h5"`` made a folder named "~" in the working
    directory (one `rm -rf ~` away from the real home). Now all of them expand it."""
    from fedmpi import sweep as sweeps
    from fedmpi.comm import LocalComm
    from fedmpi.runtime import run_experiment
    from fedmpi.runtime.state import ClientStateStore

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    config = cfg.from_dict({**TINY, "rounds": 1, "output": "~/runs/{name}.h5",
                            "system": {"state_dir": "~/spill"}})
    assert config.output_path() == home / "runs" / "tiny.h5"
    run_experiment(config, LocalComm(), quiet=True)
    assert (home / "runs" / "tiny.h5").is_file() and list(work.iterdir()) == []
    store = ClientStateStore({"c": 4}, memory_bytes=0, directory=config.system.state_dir)
    store.put(0, {"c": np.ones(4, dtype=np.float32)})
    assert (home / "spill").is_dir() and list(work.iterdir()) == []
    store.close()
    (work / "s.toml").write_text('preset = "default"\noutdir = "~/sweeps"\n[grid]\nseed = [1]\n')
    assert sweeps.load(work / "s.toml").cell(0).output == home / "sweeps" / "s" / "seed=1.h5"
    with pytest.raises(UsageError, match="system.state_dir: .* exists and is not a directory"):
        (home / "file").write_text("x")
        cfg.from_dict({**TINY, "system": {"state_dir": "~/file"}})


def test_plugin_that_registers_nothing_is_fine_one_that_breaks_is_one_line(tmp_path, monkeypatch):
    assert cfg.resolve(overrides=['plugins=["os"]']).plugins == ["os"]
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('needs a licence\\nserver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ("config field plugins: cannot import 'broken_plugin' (RuntimeError: needs a "
            "licence server)") in refused(['plugins=["broken_plugin"]'])


@pytest.mark.slow
def test_names_and_placeholders_on_the_command_line(tmp_path):
    """The two that were tracebacks (AttributeError, ValueError) through the real CLI; the
    run leaves nothing on disk."""
    assert_usage_error(fedmpi(["config", "--set", "output=runs/{name.x}.h5"]),
                       "config field output: bad placeholder")
    assert_usage_error(fedmpi(["config", "--set", 'plugins=[""]']),
                       "config field plugins: cannot import ''")
    config = write_config(tmp_path / "c.toml")
    proc = fedmpi(["run", str(config), "--set", "name=a/b",
                   "--set", f"output={tmp_path}/{{name}}.h5"])
    assert_usage_error(proc, "config field name: must not contain '/'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]
