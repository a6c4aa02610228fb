"""Checks of a built config, and the one step that fills in what a config leaves out.

``from_dict`` is the whole path from plain data: build the dataclasses (``coerce``),
import the plugins, then ``resolve_and_validate``: range and cross-field checks, and the
partition's, model's and algorithm's parameters written out with their defaults (so the
results file says what actually ran). The ``_validate_*`` helpers only check.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import socket
from pathlib import Path

from .coerce import build, check_scalar, field_error, one_of as _one_of, positive as _positive
from .schema import OPEN_SECTIONS, ExperimentConfig, upgrade
from .validate_personal import validate_personal
from .validate_privacy import validate_privacy
from .validate_robust import validate_robust, validate_tracking
from .validate_system import validate_system_model
from .vocab import (ASYNC_MODES, DOWN_CODECS, EMPTY_ROUNDS, FEEDBACK, FINETUNE_HEADS,
                    GROUP_MAX, LINEAR_HEADS, LOCAL_OPTIMIZERS, LOCAL_SCHEDULES, PRECISIONS,
                    PROBES, ROUND_SCHEDULES, SAMPLING, UP_CODECS)

# deferred imports: fedmpi.algorithms imports this package (a cycle at load time), and it,
# .models and .data import torch, which this package must not load: fedmpi.analysis,
# torch-free, imports it. The checks that need them import them when they run.

NAME_MAX = 255  # bytes in one file name on every common file system
PATH_MAX = 4096  # bytes in a path the kernel takes (Linux), with its closing NUL


def from_dict(values: dict) -> ExperimentConfig:
    """Plain config data (a TOML file's, a results file's) -> the resolved, checked config."""
    config = build(ExperimentConfig, upgrade(values), "")
    import_plugins(config.plugins)
    resolve_and_validate(config)
    return config


def import_plugins(modules: list[str]) -> None:
    """Import user modules whose ``@register`` adds algorithms (``fedmpi.algorithms.register``)
    or datasets (``fedmpi.data.register``): fedmpi never edits core code for a new method
    or a new dataset."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise field_error("plugins", f"cannot import {name!r} ({exc})") from None
        except Exception as exc:  # "" or ".rel" (ValueError, TypeError), a broken plugin
            detail = " ".join(str(exc).split()) or "no message"
            raise field_error("plugins", f"cannot import {name!r} "
                                         f"({type(exc).__name__}: {detail})") from None


def resolve_and_validate(c: ExperimentConfig) -> None:
    """Range checks and cross-field checks, and the one place a config is changed: the
    partition's, model's and algorithm's parameters are replaced by their resolved form
    (defaults filled in), so the config and the results file say what actually ran."""
    from .. import algorithms, models
    from ..data import DATASETS, check_dataset_options, partition_params

    for name, value in (("rounds", c.rounds), ("clients.num", c.clients.num),
                        ("clients.per_round", c.clients.per_round),
                        ("train.local_epochs", c.train.local_epochs),
                        ("train.batch_size", c.train.batch_size), ("train.lr", c.train.lr),
                        ("train.lr_decay", c.train.lr_decay), ("train.global_lr", c.train.global_lr),
                        ("eval.every", c.eval.every)):
        _positive(name, value)
    _positive("eval.batch_size", c.eval.batch_size, allow_zero=True)
    for name, value in (("train.weight_decay", c.train.weight_decay),
                        ("train.grad_clip", c.train.grad_clip), ("system.threads", c.system.threads),
                        ("data.crop_padding", c.data.crop_padding),
                        ("data.public_size", c.data.public_size),
                        ("system.state_memory_mb", c.system.state_memory_mb),
                        ("system.checkpoint_every", c.system.checkpoint_every)):
        _positive(name, value, allow_zero=True)
    _check_fixed(c, "")  # finite numbers, integers in range, no control characters
    if c.clients.per_round > c.clients.num:
        raise field_error("clients.per_round", f"{c.clients.per_round} exceeds clients.num = {c.clients.num}")
    _validate_sampling(c)
    _one_of("data.dataset", c.data.dataset, DATASETS)
    _validate_device(c.system.device)
    _one_of("system.precision", c.system.precision, PRECISIONS)
    _one_of("data.public_from", c.data.public_from, {"train", "test"})
    _validate_skew(c)
    _validate_modality(c)
    _validate_probes(c)
    _validate_train(c)
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
                                                    c.model.options, c.train)
    if algorithms.REGISTRY[c.algorithm.name].needs_public and not c.data.public_size:
        raise field_error("data.public_size", f"algorithm {c.algorithm.name!r} needs a server-"
                          f"side public set; set it > 0 (fnrfl_fmnist uses 320)")
    _validate_optimizer_method(c)
    _validate_client_group(c)
    validate_system_model(c)
    _validate_compression(c)
    validate_privacy(c)
    validate_personal(c)
    validate_robust(c)
    validate_tracking(c)
    _validate_paths(c)


def _validate_train(c: ExperimentConfig) -> None:
    """The local optimizer: schedules by name, their parameters in range."""
    tr = c.train
    _one_of("train.lr_schedule", tr.lr_schedule, ROUND_SCHEDULES)
    _one_of("train.local_schedule", tr.local_schedule, LOCAL_SCHEDULES)
    _positive("train.lr_step", tr.lr_step)
    _positive("train.local_decay", tr.local_decay)
    for name in ("lr_min", "warmup_rounds", "local_warmup", "momentum"):
        _positive(f"train.{name}", getattr(tr, name), allow_zero=True)
    if tr.lr_schedule == "cosine" and tr.lr_min > tr.lr:
        raise field_error("train.lr_min", f"must be <= train.lr = {tr.lr} (the cosine "
                                          f"schedule decays from lr to lr_min), got {tr.lr_min}")
    if tr.momentum >= 1:
        raise field_error("train.momentum", f"must be in [0, 1), got {tr.momentum}")
    _one_of("train.optimizer", tr.optimizer, LOCAL_OPTIMIZERS)
    if len(tr.adam_betas) != 2 or not all(0 <= b < 1 for b in tr.adam_betas):
        raise field_error("train.adam_betas", f"must be two numbers in [0, 1) (beta1, beta2), "
                                              f"got {tr.adam_betas}")
    _positive("train.adam_eps", tr.adam_eps)
    if tr.optimizer == "adam" and tr.nesterov:
        raise field_error("train.nesterov", "must be false with train.optimizer = \"adam\" "
                                            "(Adam's first moment is its momentum: train.adam_betas)")
    if tr.optimizer == "adam" and tr.momentum:
        raise field_error("train.momentum", f"must be 0 with train.optimizer = \"adam\" (Adam's "
                                            f"first moment is its momentum: train.adam_betas), "
                                            f"got {tr.momentum}")
    if tr.nesterov and not tr.momentum:
        raise field_error("train.nesterov", "needs train.momentum > 0 (Nesterov is a kind of "
                                            "momentum)")


def _validate_optimizer_method(c: ExperimentConfig) -> None:
    """``train.optimizer = "adam"`` with a method whose formulas assume SGD local steps
    (``Algorithm.local_sgd_only``: the method, a class it extends, or a method it is
    built over, FNR-FL's base) is refused, naming the method and why."""
    if c.train.optimizer == "sgd":
        return
    from .. import algorithms

    method = algorithms.build(c.algorithm.name, c.algorithm.params)
    for alg in (method, *(v for v in vars(method).values() if isinstance(v, algorithms.Algorithm))):
        if alg.local_sgd_only:
            which = repr(c.algorithm.name) if alg is method else \
                f"{c.algorithm.name!r} over {alg.name!r}"
            raise field_error("train.optimizer", f"{c.train.optimizer!r} is not allowed with "
                                                 f"{which}: {alg.local_sgd_only}; use \"sgd\"")




def _validate_client_group(c: ExperimentConfig) -> None:
    """``system.client_group``: 1, an integer G up to GROUP_MAX or "auto"; G > 1 needs an
    algorithm with a group form of its local update and a model that a group can share
    (no dropout, whose draws would be the group's rather than each client's; no
    recurrent layers). "auto" is 1 wherever G > 1 would be refused."""
    group = c.system.client_group
    if group == "auto" or (isinstance(group, int) and 1 <= group <= GROUP_MAX):
        pass
    else:
        raise field_error("system.client_group", f"must be an integer in [1, {GROUP_MAX}] or "
                                                 f"\"auto\", got {group!r}")
    problem = None if group in (1, "auto") else group_refusal(c)
    if problem:
        raise field_error("system.client_group", problem)


def group_refusal(c: ExperimentConfig) -> str | None:
    """Why this config's method or model cannot train in client groups, or None: refused
    for an explicit G > 1, and "auto" trains one client after another then."""
    from .. import algorithms, models

    if c.system_model.policy in ASYNC_MODES:
        return (f"system_model.policy {c.system_model.policy!r} trains each client on its own "
                f"model version; set 1 (one client after another)")
    if c.privacy.mechanism == "sample":
        return ("privacy.mechanism \"sample\" (DP-SGD) takes each client's per-sample "
                "gradients on its own; set 1 (one client after another)")
    if c.train.optimizer != "sgd":
        return (f"train.optimizer {c.train.optimizer!r} has no group form (a client group "
                f"takes SGD steps, fedmpi.algorithms.group_sgd); set 1 (one client after "
                f"another)")
    if not algorithms.REGISTRY[c.algorithm.name].trains_in_groups():
        able = sorted(n for n, cls in algorithms.REGISTRY.items() if cls.trains_in_groups())
        return (f"algorithm {c.algorithm.name!r} has no group form of its local update yet; "
                f"set 1 (one client after another) or use one of {', '.join(able)}")
    problem = models.group_problem(c.model.name, c.model.options)
    return f"{problem}; set 1 (one client after another)" if problem else None


def _validate_compression(c: ExperimentConfig) -> None:
    """``[compression]``: codecs from the lists, settings in range, and messages the
    algorithm declares compressible."""
    from .. import algorithms

    z = c.compression
    _one_of("compression.up", z.up, UP_CODECS)
    _one_of("compression.down", z.down, DOWN_CODECS)
    _one_of("compression.feedback", z.feedback, FEEDBACK)
    if not 1 <= z.bits <= 16:
        raise field_error("compression.bits", f"must be in 1..16, got {z.bits}")
    if not 0 < z.fraction <= 1:
        raise field_error("compression.fraction", f"must be in (0, 1], got {z.fraction}")
    _positive("compression.count", z.count, allow_zero=True)
    _positive("compression.bucket", z.bucket, allow_zero=True)
    if z.up == "none" and z.down == "none":
        if z.error_feedback:
            raise field_error("compression.error_feedback", "feeds back what an upload codec "
                                                           "drops; set compression.up")
        return
    alg = algorithms.build(c.algorithm.name, c.algorithm.params)
    declared = alg.compressible(1)
    if not declared["up"] and not declared["down"]:
        raise field_error("compression.up" if z.up != "none" else "compression.down",
                          f"algorithm {c.algorithm.name!r} declares no message that may be "
                          f"compressed")
    if z.up == "none":
        return
    if not isinstance(z.messages, list) or not z.messages or \
            len(set(map(str, z.messages))) != len(z.messages):
        raise field_error("compression.messages", f"a list of distinct upload names, got "
                                                  f"{z.messages!r}")
    for name in z.messages:
        if name not in declared["up"]:
            raise field_error("compression.messages", f"{name!r} is not an upload algorithm "
                              f"{c.algorithm.name!r} declares compressible (those: "
                              f"{', '.join(declared['up'])})")


def _check_fixed(obj, prefix: str) -> None:
    """``check_scalar`` on every fixed field of ``obj`` and its sections (open sections'
    extra keys are checked with what they belong to)."""
    open_field = OPEN_SECTIONS.get(prefix.rstrip("."))
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
        raise field_error("name", "must not be empty (it names the run and its results file)")
    if "/" in c.name:
        raise field_error("name", f"must not contain '/' (it goes into file names through {{name}}), "
                                  f"got {c.name!r}")
    if not c.output:
        raise field_error("output", "must not be empty; give a results file path, e.g. "
                                    "runs/{name}-{algorithm}-seed{seed}-{digest}.h5")
    try:
        path = os.path.expanduser(c.output.format(**c.placeholders()))
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise field_error("output", f"bad placeholder {exc}; allowed: {{name}} {{algorithm}} "
                                    f"{{dataset}} {{seed}} {{digest}}") from None
    if path.endswith("/") or Path(path).name in ("", ".", ".."):
        raise field_error("output", f"{path!r} names a directory; give a results file path in it, "
                                    f"e.g. {path.rstrip('/') or '.'}/{{name}}.h5")
    for part in Path(path).parts:
        if len(part.encode()) > NAME_MAX:
            raise field_error("output", f"file name {part[:40]}... is {len(part.encode())} bytes, "
                                        f"more than the {NAME_MAX} a file system takes (shorten "
                                        f"name or output)")
    # the hidden files beside the results file (its lock, the temporary that builds or
    # repairs it: .NAME.HOST.PID.recover) must fit as well
    room = len(f"..{socket.gethostname()}.{'9' * 7}.recover".encode())
    name, whole = Path(path).name, len(os.fsencode(os.path.abspath(path)))
    if len(name.encode()) > NAME_MAX - room:
        raise field_error("output", f"file name {name[:40]}... is {len(name.encode())} bytes; with "
                                    f"the hidden files fedmpi keeps beside it (.NAME.HOST.PID.tmp) "
                                    f"a file system takes at most {NAME_MAX - room} here (shorten "
                                    f"name or output)")
    if whole + room >= PATH_MAX:
        raise field_error("output", f"{path[:40]}... is {whole} bytes as an absolute path; with "
                                    f"the hidden files fedmpi keeps beside it the kernel takes at "
                                    f"most {PATH_MAX - 1 - room} (shorten output)")
    state_dir = c.system.state_dir and os.path.expanduser(c.system.state_dir)
    if state_dir and Path(state_dir).exists() and not Path(state_dir).is_dir():
        raise field_error("system.state_dir", f"{state_dir} exists and is not a directory")


# Least value of a dataset's integer option (counts and sizes), when not 1.
_DATA_OPTION_LEAST = {"num_classes": 2}


def _validate_data_options(c: ExperimentConfig) -> None:
    """Dataset options (data.<option>) by the type of the loader's default: counts and
    sizes integers >= 1, fractions finite numbers, folders strings. The loader checks
    them again (ranges of its own, e.g. shakespeare's test_fraction in (0, 1)); here a
    wrong type fails before any MPI work."""
    from ..data import DATASETS

    parameters = inspect.signature(DATASETS[c.data.dataset].load).parameters
    for key, value in c.data.options.items():
        name, default = f"data.{key}", parameters[key].default
        if isinstance(default, int) and not isinstance(default, bool):
            least = _DATA_OPTION_LEAST.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise field_error(name, f"must be an integer >= {least}, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise field_error(name, f"expected a number, got {value!r}")
        elif default is None or isinstance(default, str):
            if not isinstance(value, str):
                raise field_error(name, f"expected a string (a folder path), got {value!r}")
        check_scalar(name, value)


def _validate_skew(c: ExperimentConfig) -> None:
    """Feature skew and the dynamic population: ranges and the fields they need together."""
    p, cl = c.partition, c.clients
    for name, value in (("partition.noise", p.noise), ("clients.replace_every", cl.replace_every)):
        _positive(name, value, allow_zero=True)
    for name, value in (("partition.brightness", p.brightness),
                        ("partition.saturation", p.saturation), ("clients.replace_prob", cl.replace_prob)):
        if not 0 <= value <= 1:
            raise field_error(name, f"must be in [0, 1], got {value}")
    _one_of("partition.noise_mode", p.noise_mode, {"level", "space"})
    if (cl.replace_prob > 0) != (cl.replace_every > 0):
        raise field_error("clients.replace_prob", "a dynamic population needs both clients.replace_prob "
                          "> 0 and clients.replace_every > 0 (rounds between replacements)")


def _validate_sampling(c: ExperimentConfig) -> None:
    """Client sampling by name (fedmpi.runtime.plan.sample_clients); clients.per_round is
    in 1..clients.num for every scheme (bernoulli: the expected count, q = per_round / num)."""
    _one_of("clients.sampling", c.clients.sampling, SAMPLING)
    _one_of("clients.empty_rounds", c.clients.empty_rounds, EMPTY_ROUNDS)


def _validate_probes(c: ExperimentConfig) -> None:
    """Probes of a self-supervised encoder: known names, sane cadence and fractions."""
    from .. import algorithms

    e = c.eval
    for probe in e.probes:
        _one_of("eval.probes", probe, PROBES)
    _positive("eval.probe_every", e.probe_every, allow_zero=True)
    for name in ("eval.linear_epochs", "eval.finetune_epochs"):
        _positive(name, getattr(e, name.split(".")[1]))
    _one_of("eval.finetune_head", e.finetune_head, FINETUNE_HEADS)
    _one_of("eval.linear_head", e.linear_head, LINEAR_HEADS)
    if not e.finetune_fractions or not all(0 < f <= 1 for f in e.finetune_fractions):
        raise field_error("eval.finetune_fractions",
                          f"must be fractions in (0, 1], got {e.finetune_fractions}")
    method = algorithms.REGISTRY.get(c.algorithm.name)
    if e.local_spectra and "spectrum" not in e.probes:
        raise field_error("eval.local_spectra", 'needs "spectrum" in eval.probes (local spectra are '
                          'taken on probe rounds)')
    if e.probes and method is not None and method.supervised:
        raise field_error("eval.probes", f"probe a self-supervised encoder; algorithm "
                          f"{c.algorithm.name!r} trains a classifier (its test_acc is the measure)")


def _validate_modality(c: ExperimentConfig) -> None:
    """The model takes the dataset's modality (text: the LSTM, tabular features: the MLP,
    images: the rest), and image transforms go with images only. The modality is known
    without loading (an arrays file's is read from its header), after the options are
    checked, so a misspelt option is named before the dataset looks at its files."""
    from ..data import check_dataset_options, dataset_modality
    from ..models import check_model_for_data

    check_dataset_options(c.data.dataset, c.data.options)
    modality = dataset_modality(c.data.dataset, c.data.data_dir, c.data.options)
    check_model_for_data(c.model.name, modality)
    if modality == "image":
        return
    for name, value in (("data.augment", c.data.augment), ("partition.noise", c.partition.noise),
                        ("partition.brightness", c.partition.brightness),
                        ("partition.saturation", c.partition.saturation)):
        if value:
            raise field_error(name, f"is an image transform; dataset {c.data.dataset!r} is {modality}")


def _validate_device(device: str) -> None:
    if device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()):
        return
    raise field_error("system.device", f"{device!r} is not allowed; choose auto, cpu, cuda or cuda:N")
