"""An experiment's configuration: dataclasses, TOML files, presets and ``--set`` overrides.

Precedence is command line > config file or preset > defaults. Validation happens here,
before any MPI work, and every problem is a one-line ``UsageError`` that names the
field (``train.lr``) and what is allowed. Beyond each field's own range, every number
anywhere in a config is finite (NaN never; infinity only for FedU's ``algorithm.mu``),
every integer at most 2**62 in size (``seed``: 0 to 2**64 - 1) and every string free of
control characters (``check_scalar``); docs/hostile-inputs.md lists the cases. The
resolved config is a plain nested dict (``to_dict``) that the results file stores as JSON.

Sections of a TOML file (every key optional)::

    name, seed, rounds, output, plugins (modules to import: your own algorithms)
    [data]       dataset, data_dir, augment, crop_padding, flip, + dataset options
    [partition]  kind, + its parameters (dirichlet: alpha, min_size, ...), feature skew
                 (noise, noise_mode, brightness, saturation)
    [clients]    num, per_round, replace_prob, replace_every
    [model]      name, channels_last, + model options (e.g. hidden = 256)
    [algorithm]  name, + algorithm parameters (e.g. mu = 0.01)
    [train]      local_epochs, batch_size, lr, lr_decay, weight_decay, clip_norm, global_lr
    [eval]       every, batch_size, update_stats, and for self-supervised runs the probes
                 (probes, probe_every, linear_epochs, finetune_epochs, finetune_fractions,
                 local_spectra)
    [system]     device, gpu_share, precision, deterministic, threads, state_memory_mb,
                 state_dir, checkpoint_every
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

from .errors import UsageError


@dataclass
class DataConfig:
    dataset: str = "mnist5k"           # see `fedmpi datasets`: synthetic | mnist5k | fashion_mnist |
                                       # mnist | cifar10 | cifar100 | tiny_imagenet | shakespeare |
                                       # arrays (your own .npz/HDF5 file: data.path) | a plugin's
    data_dir: str | None = None        # where the dataset's files are (some sources find their own)
    augment: bool = False              # random crop with padding + horizontal flip, on the device
    crop_padding: int = 4
    flip: bool = True
    public_size: int = 0               # a server-side labelled set (FNR-FL); 0 = none
    public_from: str = "train"         # train: held out before partitioning, disjoint from test;
                                       # test: the first public_size test samples (FNR-FL's paper
                                       # setting; LEAKY: the model then trains on what it is tested on)
    options: dict = field(default_factory=dict)   # dataset-specific (synthetic sizes)


@dataclass
class PartitionConfig:
    kind: str = "iid"                  # iid | dirichlet | pathological | quantity | natural
    params: dict = field(default_factory=dict)    # the kind's parameters, e.g. alpha = 0.3
    # Feature skew, on top of any kind (label + feature = a label kind with these set):
    noise: float = 0.0                 # Gaussian pixel noise (images in [0, 1]); "level": client
                                       # i of K gets std noise * i / (K - 1) (FNR-FL, NIID-Bench)
    noise_mode: str = "level"          # level | space (std = noise only in client i's image block)
    brightness: float = 0.0            # client brightness factor ~ U(1 - b, 1 + b), fixed per client
    saturation: float = 0.0            # client saturation factor ~ U(1 - s, 1 + s) (FedMIM colour skew)


@dataclass
class ClientsConfig:
    num: int = 20                      # N, the client population
    per_round: int = 5                 # S, clients sampled uniformly without replacement
    replace_prob: float = 0.0          # dynamic population (FedACG Table 3): every replace_every
    replace_every: int = 0             # rounds each client is replaced with this probability by
                                       # a fresh one (new id, no state, fresh data); 0 = static


@dataclass
class ModelConfig:
    name: str = "cnn"                  # cnn | resnet18 | vgg11 (images), lstm (text), mlp (tabular)
    channels_last: bool = True         # NHWC activations: 1.3x faster convolutions on CPU
    options: dict = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    local_epochs: int = 1              # E
    batch_size: int = 32               # B
    lr: float = 0.05                   # eta_l, local learning rate of round 0
    lr_decay: float = 1.0              # eta_l^t = lr * lr_decay^t
    weight_decay: float = 0.0
    clip_norm: float = 10.0            # clip the local gradient to this L2 norm; 0 = off
    global_lr: float = 1.0             # eta_g


@dataclass
class EvalConfig:
    every: int = 1                     # evaluate every k rounds (and always the last round)
    at_start: bool = True              # also evaluate the initial model before the first round:
                                       # /rounds row `round = 0` (test metrics only; no training,
                                       # no probes); a resumed run never evaluates it again
    batch_size: int = 0                # also the chunk a worker scores; 0 = auto: 250 when the
                                       # workers run on CPUs (activations stay in cache), 1000 on
                                       # GPUs (the value used is the file's eval_batch_size)
    update_stats: bool = False         # mean pairwise cosine of client updates and local
                                       # consistency per round (two extra d-vectors summed)
    # Self-supervised runs: probes of the global encoder into /eval (expensive; kNN runs on
    # every evaluation round regardless). Any of "linear", "finetune", "spectrum".
    probes: list = field(default_factory=list)
    probe_every: int = 0               # rounds between probes; 0 = after the last round only
    linear_epochs: int = 200           # linear probe: Adam lr 3e-3, batch 512 (FedU^2 code)
    finetune_epochs: int = 200         # fine-tuning: SGD, batch 128, crop + flip (FedU^2 code)
    finetune_fractions: list[float] = field(default_factory=lambda: [0.01, 0.1])
    local_spectra: bool = False        # also the spectrum of each client's local model on probe
                                       # rounds (FedU^2 Figure 3's local models), /local_spectra


@dataclass
class SystemConfig:
    device: str = "auto"               # auto | cpu | cuda | cuda:N (auto and cuda: one GPU per
                                       # worker, taken in rank order on each node)
    gpu_share: bool = False            # allow more workers than GPUs on a node (they share)
    precision: str = "fp32"            # fp32 | tf32 (TF32 matmuls and convolutions on NVIDIA
                                       # GPUs) | bf16 (forward and loss under bfloat16 autocast,
                                       # FP32 master weights and updates)
    deterministic: bool = False        # bitwise-identical results for any number of ranks
    threads: int = 0                   # torch threads per rank; 0 = auto: a worker takes its
                                       # share of the node's cores (all of them in a single-
                                       # process run), the server 1; deterministic runs: 1
    state_memory_mb: int = 4096        # client state kept in memory; past it, spilled to disk
    state_dir: str | None = None       # where spilled client state goes (default: a temp dir)
    checkpoint_every: int = 10         # rounds between checkpoints in the results file; 0 = only
                                       # on SIGUSR1/SIGTERM (preemption)


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    seed: int = 0
    rounds: int = 20
    output: str = "runs/{name}-{algorithm}-seed{seed}.h5"
    plugins: list = field(default_factory=list)   # modules that register algorithms/models
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    system: SystemConfig = field(default_factory=SystemConfig)

    def output_path(self) -> Path:
        return Path(self.output.format(**self.placeholders()))

    def placeholders(self) -> dict:
        """What ``output`` may name: {name} {algorithm} {dataset} {seed}."""
        return {"name": self.name, "algorithm": self.algorithm.name,
                "dataset": self.data.dataset, "seed": self.seed}

    def to_dict(self) -> dict:
        """The resolved config as nested plain data; open sections are flattened back."""
        out = dataclasses.asdict(self)
        for section, extra in _OPEN.items():
            out[section].update(out[section].pop(extra))
        return out


# Sections whose unknown keys are passed on (validated by the dataset, model or algorithm).
_OPEN = {"data": "options", "partition": "params", "model": "options", "algorithm": "params"}


# Integers end up in numpy and torch int64 arithmetic (sizes, counts, rounds, products of
# them); past 2**62 that overflows or crashes somewhere, so a bigger one is refused here.
INT_MAX = 2 ** 62
# The seed keys numpy SeedSequence (any size) and is stored as the results file's integer
# attribute "seed", which HDF5 holds as int64 or uint64: 2**64 - 1 is the largest it takes.
SEED_MAX = 2 ** 64 - 1
# Tighter caps where the consumer is smaller than int64: torch.set_num_threads takes a C
# int and every thread its stack (100000 threads crash start-up); crop_padding pads every
# image of a batch to (side + 2 p)^2 pixels.
_INT_CAPS = {"system.threads": (1024, "torch threads per rank; 0 = cores / ranks"),
             "data.crop_padding": (1024, "zero padding on each side before the random crop")}
NAME_MAX = 255  # bytes in one file name on every common file system


def _fail(field_name: str, message: str) -> UsageError:
    return UsageError(f"config field {field_name}: {message}")


def check_scalar(field_name: str, value: Any, allow_inf: bool = False, inf_hint: str = "") -> None:
    """Every value of a config, open sections included, recursively through lists and
    tables: numbers finite (NaN never; infinity only with ``allow_inf``, ``inf_hint`` says
    where it is allowed instead), integers within [-2**62, 2**62] (``seed``: [0, 2**64 - 1]),
    strings free of control characters (NUL cuts a path short, a newline splits messages)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if field_name == "seed":
            if not 0 <= value <= SEED_MAX:
                raise _fail("seed", f"must be an integer in [0, 2**64 - 1] = [0, {SEED_MAX}], "
                                    f"got {value}")
            return
        cap, what = _INT_CAPS.get(field_name, (INT_MAX, ""))
        if abs(value) > cap:
            sign = "" if value > 0 else "-"
            bound = ("at most " if value > 0 else "at least ") + \
                (f"{sign}2**62 = {sign}{INT_MAX}" if cap == INT_MAX else f"{sign}{cap}")
            raise _fail(field_name, f"must be {bound}{f' ({what})' if what else ''}, got {value}")
    elif isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            allowed = "a number (inf allowed)" if allow_inf else "a finite number"
            raise _fail(field_name, f"must be {allowed}, got {value}{inf_hint}")
    elif isinstance(value, str):
        bad = next((ch for ch in value if ord(ch) < 32 or ord(ch) == 127), None)
        if bad is not None:
            raise _fail(field_name, f"must not contain control characters, got {value!r}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_scalar(field_name, item, allow_inf, inf_hint)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_scalar(f"{field_name}.{key}", item, allow_inf, inf_hint)


def _coerce(field_name: str, value: Any, kind) -> Any:
    """Check one scalar against its annotated type (no silent str->number guessing)."""
    optional = kind == (str | None)
    if value is None and optional:
        return None
    if kind == list[float]:
        if not isinstance(value, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise _fail(field_name, f"expected a list of numbers, got {value!r}")
        return [_float(field_name, v) for v in value]
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _fail(field_name, f"expected a list of strings, got {value!r}")
        return value
    base = str if optional else kind
    if base is bool:
        if not isinstance(value, bool):
            raise _fail(field_name, f"expected true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(field_name, f"expected an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(field_name, f"expected a number, got {value!r}")
        return _float(field_name, value)
    if not isinstance(value, str):
        raise _fail(field_name, f"expected a string, got {value!r}")
    return value


def _float(field_name: str, value: int | float) -> float:
    """A number as a float; an integer too large for one (10**400) is not a finite number."""
    try:
        return float(value)
    except OverflowError:
        raise _fail(field_name, f"must be a finite number, got {value}") from None


def _build(cls, values: dict, prefix: str):
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    open_field = _OPEN.get(prefix.rstrip("."))
    known, extra = {}, {}
    for key, value in values.items():
        if key in names and key != open_field and dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise _fail(prefix + key, "expected a table (section)")
            known[key] = _build(hints[key], value, f"{key}.")
        elif key in names and key != open_field:
            known[key] = _coerce(prefix + key, value, hints[key])
        elif open_field:
            extra[key] = value
        else:
            allowed = ", ".join(sorted(names))
            raise _fail(prefix + key, f"unknown key; allowed: {allowed}")
    if open_field:
        known[open_field] = extra
    return cls(**known)


def from_dict(values: dict) -> ExperimentConfig:
    config = _build(ExperimentConfig, values, "")
    import_plugins(config.plugins)
    validate(config)
    return config


def import_plugins(modules: list[str]) -> None:
    """Import user modules whose ``@register`` adds algorithms (``fedmpi.algorithms.register``)
    or datasets (``fedmpi.data.register``): fedmpi never edits core code for a new method
    or a new dataset."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise _fail("plugins", f"cannot import {name!r} ({exc})") from None
        except Exception as exc:  # "" or ".rel" (ValueError, TypeError), a broken plugin
            detail = " ".join(str(exc).split()) or "no message"
            raise _fail("plugins", f"cannot import {name!r} "
                                   f"({type(exc).__name__}: {detail})") from None


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise _fail(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _one_of(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise _fail(name, f"{value!r} is not allowed; choose one of {', '.join(sorted(allowed))}")


def validate(c: ExperimentConfig) -> None:
    """Range checks and cross-field checks; fills in model and algorithm defaults."""
    from . import algorithms, models
    from .data import DATASETS, check_dataset_options, partition_params

    for name, value in (("rounds", c.rounds), ("clients.num", c.clients.num),
                        ("clients.per_round", c.clients.per_round),
                        ("train.local_epochs", c.train.local_epochs),
                        ("train.batch_size", c.train.batch_size), ("train.lr", c.train.lr),
                        ("train.lr_decay", c.train.lr_decay), ("train.global_lr", c.train.global_lr),
                        ("eval.every", c.eval.every)):
        _positive(name, value)
    _positive("eval.batch_size", c.eval.batch_size, allow_zero=True)
    for name, value in (("train.weight_decay", c.train.weight_decay),
                        ("train.clip_norm", c.train.clip_norm), ("system.threads", c.system.threads),
                        ("data.crop_padding", c.data.crop_padding),
                        ("data.public_size", c.data.public_size),
                        ("system.state_memory_mb", c.system.state_memory_mb),
                        ("system.checkpoint_every", c.system.checkpoint_every)):
        _positive(name, value, allow_zero=True)
    _check_fixed(c, "")  # finite numbers, integers in range, no control characters
    if c.clients.per_round > c.clients.num:
        raise _fail("clients.per_round", f"{c.clients.per_round} exceeds clients.num = {c.clients.num}")
    _one_of("data.dataset", c.data.dataset, DATASETS)
    _validate_device(c.system.device)
    _one_of("system.precision", c.system.precision, PRECISIONS)
    _one_of("data.public_from", c.data.public_from, {"train", "test"})
    _validate_skew(c)
    _validate_modality(c)
    _validate_probes(c)
    c.partition.params = partition_params(c.partition.kind, c.partition.params)
    check_dataset_options(c.data.dataset, c.data.options)
    _validate_data_options(c)
    # Resolved = every parameter written out, so the results file says what actually ran.
    c.model.options = models.check_options(c.model.name, c.model.options)
    # What the kind's and the model's own checks let through (NaN, 10**30): algorithm
    # parameters are checked by algorithms.build, before their Params class sees them.
    check_scalar("partition", c.partition.params)
    check_scalar("model", c.model.options)
    c.algorithm.params = algorithms.resolved_params(c.algorithm.name, c.algorithm.params,
                                                    c.model.options)
    _validate_paths(c)


def _check_fixed(obj, prefix: str) -> None:
    """``check_scalar`` on every fixed field of ``obj`` and its sections (open sections'
    extra keys are checked with what they belong to)."""
    open_field = _OPEN.get(prefix.rstrip("."))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_fixed(value, f"{f.name}.")
        elif f.name != open_field:
            check_scalar(prefix + f.name, value)


def _validate_paths(c: ExperimentConfig) -> None:
    """``name`` goes into file names; ``output`` must format to a file path that a file
    system can create (one component at most 255 bytes); ``system.state_dir``, when it
    exists, must be a directory (client state spills there mid-run)."""
    if not c.name:
        raise _fail("name", "must not be empty (it names the run and its results file)")
    if "/" in c.name:
        raise _fail("name", f"must not contain '/' (it goes into file names through {{name}}), "
                            f"got {c.name!r}")
    if not c.output:
        raise _fail("output", "must not be empty; give a results file path, e.g. "
                              "runs/{name}-{algorithm}-seed{seed}.h5")
    try:
        path = c.output.format(**c.placeholders())
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise _fail("output", f"bad placeholder {exc}; allowed: {{name}} {{algorithm}} "
                              f"{{dataset}} {{seed}}") from None
    if path.endswith("/") or Path(path).name in ("", ".", ".."):
        raise _fail("output", f"{path!r} names a directory; give a results file path in it, "
                              f"e.g. {path.rstrip('/') or '.'}/{{name}}.h5")
    for part in Path(path).parts:
        if len(part.encode()) > NAME_MAX:
            raise _fail("output", f"file name {part[:40]}... is {len(part.encode())} bytes, "
                                  f"more than the {NAME_MAX} a file system takes (shorten "
                                  f"name or output)")
    state_dir = c.system.state_dir
    if state_dir and Path(state_dir).exists() and not Path(state_dir).is_dir():
        raise _fail("system.state_dir", f"{state_dir} exists and is not a directory")


# Least value of a dataset's integer option (counts and sizes), when not 1.
_DATA_OPTION_LEAST = {"num_classes": 2}


def _validate_data_options(c: ExperimentConfig) -> None:
    """Dataset options (data.<option>) by the type of the loader's default: counts and
    sizes integers >= 1, fractions finite numbers, folders strings. The loader checks
    them again (ranges of its own, e.g. shakespeare's test_fraction in (0, 1)); here a
    wrong type fails before any MPI work."""
    import inspect

    from .data import DATASETS

    parameters = inspect.signature(DATASETS[c.data.dataset].load).parameters
    for key, value in c.data.options.items():
        name, default = f"data.{key}", parameters[key].default
        if isinstance(default, int) and not isinstance(default, bool):
            least = _DATA_OPTION_LEAST.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise _fail(name, f"must be an integer >= {least}, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _fail(name, f"expected a number, got {value!r}")
        elif default is None or isinstance(default, str):
            if not isinstance(value, str):
                raise _fail(name, f"expected a string (a folder path), got {value!r}")
        check_scalar(name, value)


def _validate_skew(c: ExperimentConfig) -> None:
    """Feature skew and the dynamic population: ranges and the fields they need together."""
    p, cl = c.partition, c.clients
    for name, value in (("partition.noise", p.noise), ("clients.replace_every", cl.replace_every)):
        _positive(name, value, allow_zero=True)
    for name, value in (("partition.brightness", p.brightness),
                        ("partition.saturation", p.saturation), ("clients.replace_prob", cl.replace_prob)):
        if not 0 <= value <= 1:
            raise _fail(name, f"must be in [0, 1], got {value}")
    _one_of("partition.noise_mode", p.noise_mode, {"level", "space"})
    if (cl.replace_prob > 0) != (cl.replace_every > 0):
        raise _fail("clients.replace_prob", "a dynamic population needs both clients.replace_prob "
                    "> 0 and clients.replace_every > 0 (rounds between replacements)")


PROBES = ("linear", "finetune", "spectrum")
PRECISIONS = ("fp32", "tf32", "bf16")


def _validate_probes(c: ExperimentConfig) -> None:
    """Probes of a self-supervised encoder: known names, sane cadence and fractions."""
    from . import algorithms

    e = c.eval
    for probe in e.probes:
        _one_of("eval.probes", probe, PROBES)
    _positive("eval.probe_every", e.probe_every, allow_zero=True)
    for name in ("eval.linear_epochs", "eval.finetune_epochs"):
        _positive(name, getattr(e, name.split(".")[1]))
    if not e.finetune_fractions or not all(0 < f <= 1 for f in e.finetune_fractions):
        raise _fail("eval.finetune_fractions", f"must be fractions in (0, 1], got {e.finetune_fractions}")
    method = algorithms.REGISTRY.get(c.algorithm.name)
    if e.local_spectra and "spectrum" not in e.probes:
        raise _fail("eval.local_spectra", 'needs "spectrum" in eval.probes (local spectra are '
                    'taken on probe rounds)')
    if e.probes and method is not None and method.supervised:
        raise _fail("eval.probes", f"probe a self-supervised encoder; algorithm "
                    f"{c.algorithm.name!r} trains a classifier (its test_acc is the measure)")


def _validate_modality(c: ExperimentConfig) -> None:
    """The model takes the dataset's modality (text: the LSTM, tabular features: the MLP,
    images: the rest), and image transforms go with images only. The modality is known
    without loading (an arrays file's is read from its header), after the options are
    checked, so a misspelt option is named before the dataset looks at its files."""
    from .data import check_dataset_options, dataset_modality
    from .models import check_model_for_data

    check_dataset_options(c.data.dataset, c.data.options)
    modality = dataset_modality(c.data.dataset, c.data.data_dir, c.data.options)
    check_model_for_data(c.model.name, modality)
    if modality == "image":
        return
    for name, value in (("data.augment", c.data.augment), ("partition.noise", c.partition.noise),
                        ("partition.brightness", c.partition.brightness),
                        ("partition.saturation", c.partition.saturation)):
        if value:
            raise _fail(name, f"is an image transform; dataset {c.data.dataset!r} is {modality}")


def _validate_device(device: str) -> None:
    if device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()):
        return
    raise _fail("system.device", f"{device!r} is not allowed; choose auto, cpu, cuda or cuda:N")


# ---- sources: files, presets, overrides -------------------------------------------------

def presets() -> list[str]:
    root = resources.files("fedmpi.presets")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def _read_toml(text: str, origin: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{origin}: not valid TOML ({exc})") from None
    except RecursionError:
        raise UsageError(f"{origin}: not valid TOML (arrays or tables nested too deeply)") from None


def load_preset(name: str) -> dict:
    if name not in presets():
        raise UsageError(f"preset {name!r} does not exist; available: {', '.join(presets())}")
    text = resources.files("fedmpi.presets").joinpath(f"{name}.toml").read_text()
    return _read_toml(text, f"preset {name}")


# A config is a few KB of TOML; past this it is something else (a results file, a device).
CONFIG_MAX_BYTES = 16 * 2 ** 20


def load_file(path: str | Path) -> dict:
    """A TOML config file; a missing, unreadable or binary one (a PNG, a results file) is
    a one-line UsageError that names the path. A UTF-8 byte order mark is skipped."""
    return read_toml_file(path, "config file")


def read_toml_file(path: str | Path, what: str) -> dict:
    """The TOML file ``path`` (``what``: "config file", "sweep file") as a dict; every way
    it can fail is a one-line UsageError that starts with ``what`` and the path."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory")
    if not path.exists():
        raise UsageError(f"{what} {path} does not exist")
    try:
        with open(path, "rb") as f:  # also a pipe: fedmpi run <(...)
            data = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise UsageError(f"{what} {path} is not a TOML text file (more than "
                         f"{CONFIG_MAX_BYTES // 2 ** 20} MiB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {path} is not a TOML text file (byte "
                         f"0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8)") from None
    if "\0" in text:  # valid UTF-8, but TOML forbids it: a binary file
        raise UsageError(f"{what} {path} is not a TOML text file (NUL byte at offset "
                         f"{data.index(0)})")
    text = text.removeprefix("\ufeff")  # the byte order mark some editors write
    return _read_toml(text, f"{what} {path}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.lr=0.1`` -> (["train", "lr"], 0.1); the value is read as a TOML value,
    and taken as a plain string when it is not one (``data.dataset=mnist``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=0.1")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError:
        raise UsageError(f"--set {key.strip()}=...: value nested too deeply") from None
    return key.strip().split("."), value


# The key that chooses what an open section's extra keys mean: changing it on the command
# line drops the extras that came from the file or preset (they belonged to the old choice),
# except algorithm parameters the new algorithm also takes (the SSL heads, SAM's rho, ...).
_SELECTORS = {"partition": "kind", "algorithm": "name", "model": "name", "data": "dataset"}


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """``--set`` on top of ``values``. ``--set partition.kind=pathological`` on a preset
    with ``alpha`` drops that alpha (and likewise model and dataset parameters, and the
    algorithm parameters the new algorithm does not take); parameters given by other
    ``--set``s are kept."""
    values = copy.deepcopy(values)
    for text in overrides:
        path, value = parse_override(text)
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"--set {text!r}: {part} is not a section")
        if len(path) == 2 and _SELECTORS.get(path[0]) == path[1] and node.get(path[1]) != value:
            _drop_extras(path[0], node, overrides, value)
        node[path[-1]] = value
    return values


def _drop_extras(section: str, node: dict, overrides: list[str], choice) -> None:
    cls = get_type_hints(ExperimentConfig)[section]
    fixed = {f.name for f in dataclasses.fields(cls)}
    given = {p[1] for p in (parse_override(t)[0] for t in overrides) if len(p) == 2 and p[0] == section}
    shared = _algorithm_parameters(choice) if section == "algorithm" else set()
    for key in [k for k in node if k not in fixed and k not in given and k not in shared]:
        del node[key]


def _algorithm_parameters(name) -> set[str]:
    """The parameters algorithm ``name`` takes (none if it is unknown, e.g. a plugin's)."""
    from .algorithms import REGISTRY

    cls = REGISTRY.get(name) if isinstance(name, str) else None
    return {f.name for f in dataclasses.fields(cls.Params)} if cls else set()


def resolve(path: str | None = None, preset: str | None = None,
            overrides: list[str] = ()) -> ExperimentConfig:
    """File or preset (default preset ``default``), then ``--set`` overrides, validated."""
    if path and preset:
        raise UsageError("give a config file or --preset, not both")
    values = load_file(path) if path else load_preset(preset or "default")
    return from_dict(apply_overrides(values, list(overrides)))


def to_toml(values: dict) -> str:
    """The resolved config as TOML that ``fedmpi run FILE`` reads back to the same config."""
    top = [f"{k} = {toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
    lines = top + [""]
    for section, table in values.items():
        if isinstance(table, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
            lines.append("")
    return "\n".join(lines)


def toml_value(value) -> str:
    """A Python value as a TOML literal (what TOML files and ``--set`` read back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # e.g. FNR-FL's base_params
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)
