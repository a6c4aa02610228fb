"""The dataset registry: every dataset fedmpi can load, built-in or a plugin's, in one table.

A dataset is a loader ``load(data_dir=None, seed=0, <option>=<default>, ...) -> Dataset``
registered with ``@register(name, modality=..., locate=..., hint=...)``: the built-in ones
in `fedmpi.data.sources` and `fedmpi.data.arrays`, yours in a module that a config names
in ``plugins``. The config-time questions (does the dataset exist, which options does it
take, which modality is its data) are answered from the registration, without loading;
`load_dataset` calls the loader and `check_dataset` validates what it returns, so a
dataset reaches training only well formed, and a bad one is a one-line UsageError that
names it. `check_arrays` holds the checks that the `arrays` file format shares with
every loader's result.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from fedmpi.errors import UsageError

MODALITIES = ("image", "text", "tabular")
# Labels (and text token ids) index a classifier (and the LSTM's embedding) of
# num_classes rows: a label of 10**12 would allocate terabytes, so past this it is refused.
MAX_CLASSES = 2 ** 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the shared checks call each array: the arrays file's names -> Dataset fields.
FIELDS = {"x_train": "train_x", "y_train": "train_y", "x_test": "test_x", "y_test": "test_y",
          "groups": "groups"}
_SHAPES = {"image": "[N, C, H, W] images", "text": "[N, T] token ids",
           "tabular": "[N, F] features"}


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset. ``modality`` is "image", "text" or "tabular", or a function
    called like the loader, ``modality(data_dir, **options)``, for a dataset whose files
    decide it (`arrays`). ``locate(data_dir)`` says where the data is, or None when it is
    missing (`fedmpi datasets`; it must only look, never parse); ``hint`` how to get it."""

    name: str
    load: Callable[..., Any]
    modality: str | Callable[..., str]
    locate: Callable[[str | None], Path | str | None] | None
    hint: str
    client_tests: bool = False   # its files split each natural client's samples (LEAF):
                                 # Dataset.held_out, the local test splits of `natural`

    def options(self) -> list[str]:
        """The loader's options (config data.<option>): its parameters after data_dir, seed."""
        return [p for p in inspect.signature(self.load).parameters if p not in ("data_dir", "seed")]


DATASETS: dict[str, DatasetSpec] = {}


def register(name: str, *, modality: str | Callable[..., str] = "image",
             locate: Callable[[str | None], Path | str | None] | None = None,
             hint: str = "", client_tests: bool = False) -> Callable:
    """Decorator: make a loader selectable as ``data.dataset = name``.

    The loader is ``load(data_dir=None, seed=0, <option>=<default>, ...) -> Dataset``: the
    config's data.data_dir and seed, then its options as keyword parameters with
    defaults (config data.<option>, checked at config time against these names and the
    type of each default). A name taken already, a loader that is not callable or takes
    ``*args``/``**kwargs``, or an unknown modality is a UsageError (one line, also when a
    config's ``plugins`` imports the module).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(f"dataset name {name!r}: use letters, digits, '_', '.' and '-' "
                         f"(it goes into file names through {{dataset}})")
    if not (callable(modality) or modality in MODALITIES):
        raise UsageError(f"dataset {name!r}: modality={modality!r} is not one of "
                         f"{', '.join(map(repr, MODALITIES))} (or a function of the options)")
    if locate is not None and not callable(locate):
        raise UsageError(f"dataset {name!r}: locate={locate!r} must be a function of "
                         f"data_dir returning where the data is, or None")
    if not isinstance(hint, str):
        raise UsageError(f"dataset {name!r}: hint={hint!r} must be a string")

    def decorator(load):
        if not callable(load):
            raise UsageError(f"dataset {name!r}: register() decorates a loader function, "
                             f"got {load!r}")
        if name in DATASETS:
            raise UsageError(f"dataset {name!r} is registered already (by "
                             f"{DATASETS[name].load.__module__}); choose another name")
        _check_signature(name, load)
        DATASETS[name] = DatasetSpec(name, load, modality, locate, hint, client_tests)
        return load
    return decorator


def _check_signature(name: str, load) -> None:
    """data_dir and seed first, then options with defaults: what `load_dataset` passes and
    what config validation reads the options from."""
    try:
        params = list(inspect.signature(load).parameters.values())
    except (TypeError, ValueError):
        raise UsageError(f"dataset {name!r}: cannot read the signature of loader "
                         f"{load!r}") from None
    shape = "load(data_dir=None, seed=0, <option>=<default>, ...)"
    if [p.name for p in params[:2]] != ["data_dir", "seed"] or any(
            p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        raise UsageError(f"dataset {name!r}: loader {load.__qualname__}{inspect.signature(load)} "
                         f"must be {shape}; options are named parameters (no *args, **kwargs)")
    missing = [p.name for p in params[2:] if p.default is p.empty]
    if missing:
        raise UsageError(f"dataset {name!r}: loader option {missing[0]!r} needs a default "
                         f"(configs may leave it out); the loader must be {shape}")


def _lookup(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise UsageError(f"dataset {name!r} is unknown; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]


def has_client_tests(name: str) -> bool:
    """Whether dataset ``name``'s files give each natural client its own test samples."""
    spec = DATASETS.get(name)
    return spec is not None and spec.client_tests


def dataset_modality(name: str, data_dir: str | None = None, options: Mapping | None = None) -> str:
    """"image", "text" or "tabular", known without loading: lets config validation pair
    the model with the data (`fedmpi.models.check_model_for_data`) before any MPI work.
    A dataset whose files decide it (`arrays`) looks at them (a header, not the data)."""
    spec = _lookup(name)
    if not callable(spec.modality):
        return spec.modality
    modality = spec.modality(data_dir, **dict(options or {}))
    if modality not in MODALITIES:
        raise UsageError(f"dataset {name!r}: its modality function returned {modality!r}, "
                         f"not one of {', '.join(map(repr, MODALITIES))}")
    return modality


def check_dataset_options(name: str, options: Mapping) -> None:
    """Config-time check: the dataset exists and takes these options (data.<option>)."""
    allowed = sorted(_lookup(name).options())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UsageError(f"config field data.{unknown[0]}: not an option of dataset {name!r}; "
                         f"allowed: {', '.join(allowed) or 'none'}")


def load_dataset(name: str, data_dir: str | None = None, seed: int = 0, **options):
    """Load dataset `name`; `options` (config data.options) go to its loader: synthetic's
    sizes, tiny_imagenet's cache_dir, shakespeare's seq_len/stride/min_samples/
    test_fraction, arrays' path/modality/layout, a plugin's own. What the loader returns
    is checked (`check_dataset`)."""
    check_dataset_options(name, options)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UsageError(f"seed={seed!r}: must be a non-negative integer")
    spec = DATASETS[name]
    modality = None if callable(spec.modality) else spec.modality
    return check_dataset(_call_loader(name, spec.load, data_dir, seed, options), name, modality)


def _call_loader(name: str, load, data_dir, seed, options):
    """A plugin's loader failing (its file missing on one node, a format it cannot read)
    is the user's input: one line naming the dataset and what it raised, as a failure to
    import the plugin is. fedmpi's own loaders say their own lines; an exception of theirs
    that is not a UsageError is a bug, shown as one."""
    try:
        return load(data_dir, seed, **options)
    except (UsageError, MemoryError):   # the out-of-memory path says which rank, how much
        raise
    except Exception as exc:
        module = getattr(load, "__module__", "") or ""
        if module == "fedmpi" or module.startswith("fedmpi."):
            raise
        where = f"{module}.{getattr(load, '__qualname__', 'load')}"
        detail = " ".join(str(exc).split())
        raise UsageError(f"dataset {name!r}: its loader {where} raised "
                         f"{type(exc).__name__}{': ' + detail if detail else ''}") from None


def check_present(name: str, data_dir: str | None = None, seed: int = 0, **options) -> None:
    """Before a run claims its results file: a dataset whose files are not where its
    ``locate`` looks fails now, in its loader's own words (which file is missing where),
    not after "results file ... exists" sent the user to the wrong problem. Only a
    dataset reported missing is loaded here, and its loader fails at once."""
    spec = _lookup(name)
    if spec.locate is not None and spec.locate(data_dir) is None:
        load_dataset(name, data_dir, seed, **options)


def available_datasets(data_dir: str | None = None) -> list[tuple[str, str | None]]:
    """(name, where found or None) for every registered dataset, for `fedmpi datasets`.

    Only looks (each dataset's ``locate``); nothing is loaded. A dataset registered
    without ``locate`` is always there: its loader's module and name are the answer.
    For a missing one, ``DATASETS[name].hint`` says how to get it.
    """
    found = []
    for name, spec in DATASETS.items():
        load = spec.load
        where = spec.locate(data_dir) if spec.locate else f"{load.__module__}.{load.__qualname__}"
        found.append((name, None if where is None else str(where)))
    return found


# --- what every loader returns ------------------------------------------------------------


def check_arrays(where: str, arrays: Mapping[str, np.ndarray], modality: str, *,
                 label: Callable[[str], str] = lambda key: f"array {key!r}",
                 num_classes: int | None = None) -> None:
    """The shape and value checks that the arrays file and every loader's Dataset share.

    ``arrays``: x_train, y_train, x_test, y_test and, if any, groups (images already
    [N, C, H, W]); ``label`` names one in a message ("array 'y_train'", or the Dataset
    field "train_y"), ``where`` says whose they are (a path, "dataset 'name'"). Inputs
    have the modality's rank, samples, and the same per-sample shape in train and test;
    images are square (the models take a side, `build_model`'s image_size); labels are 1-D,
    one per sample, >= 0 (and < num_classes when given); tabular features are finite;
    groups are one id >= 0 per training sample.
    """
    def fail(message):
        raise UsageError(f"{where}: {message}")

    rank = 4 if modality == "image" else 2
    for x_key, y_key in (("x_train", "y_train"), ("x_test", "y_test")):
        x, y = arrays[x_key], arrays[y_key]
        if x.ndim != rank:
            fail(f"{label(x_key)} has shape {tuple(x.shape)}; {modality} inputs are "
                 f"{_SHAPES[modality]}")
        if 0 in x.shape:
            fail(f"{label(x_key)} is empty (shape {tuple(x.shape)})")
        if y.ndim != 1:
            fail(f"{label(y_key)} has shape {tuple(y.shape)}; labels are 1-D, one per sample")
        if len(y) != len(x):
            fail(f"{label(y_key)} has {len(y)} labels for the {len(x)} samples of {label(x_key)}")
        if y.min() < 0:
            fail(f"{label(y_key)} holds negative labels (smallest {y.min()}); labels are class "
                 f"ids 0, 1, ..., num_classes - 1")
        if num_classes is not None and y.max() >= num_classes:
            fail(f"{label(y_key)} holds label {y.max()}, out of range for num_classes = "
                 f"{num_classes}")
        if modality == "tabular" and not np.isfinite(x).all():
            i, j = np.argwhere(~np.isfinite(x))[0]
            fail(f"{label(x_key)} holds NaN or infinite features (first: sample {i}, feature {j})")
    train, test = arrays["x_train"], arrays["x_test"]
    if tuple(train.shape[1:]) != tuple(test.shape[1:]):
        fail(f"{label('x_test')} holds samples of shape {tuple(test.shape[1:])} but "
             f"{label('x_train')} {tuple(train.shape[1:])}; train and test must match")
    if modality == "image" and train.shape[2] != train.shape[3]:
        fail(f"{label('x_train')} holds {train.shape[2]}x{train.shape[3]} images; fedmpi's "
             f"models take square images")
    groups = arrays.get("groups")
    if groups is not None:
        if groups.ndim != 1 or len(groups) != len(arrays["y_train"]):
            fail(f"{label('groups')} has shape {tuple(groups.shape)}; it holds one natural-client "
                 f"id per training sample ({len(arrays['y_train'])})")
        if groups.min() < 0:
            fail(f"{label('groups')} holds negative ids (smallest {groups.min()}); natural-client "
                 f"ids are >= 0")


_INPUT_DTYPES = {"image": (torch.uint8,), "tabular": (torch.float32,),
                 "text": (torch.uint8, torch.int16, torch.int32, torch.int64)}


def check_dataset(ds, name: str, modality: str | None = None):
    """`ds` as a loader of dataset `name` returned it, checked: a `Dataset` of CPU tensors
    with the dtypes training takes (uint8 images [N, C, H, W], integer text ids [N, T],
    float32 tabular features [N, F], int64 labels), consistent shapes and labels, of the
    registered ``modality``. Returns ``ds``; anything else is one UsageError naming the
    dataset."""
    from fedmpi.data.sources import Dataset   # deferred: sources imports this module

    where = f"dataset {name!r}"

    def fail(message):
        raise UsageError(f"{where}: {message}")

    if not isinstance(ds, Dataset):
        fail(f"its loader returned {type(ds).__name__}, not a fedmpi.data.Dataset")
    if ds.modality not in MODALITIES:
        fail(f"Dataset.modality={ds.modality!r} is not one of {', '.join(map(repr, MODALITIES))}")
    if modality is not None and ds.modality != modality:
        fail(f"registered as {modality} data, but its loader returned {ds.modality} data")
    arrays = {}
    for key, attribute in FIELDS.items():
        tensor = getattr(ds, attribute)
        if key == "groups" and tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            fail(f"{attribute} is {type(tensor).__name__}, not a CPU torch.Tensor")
        wanted = _INPUT_DTYPES[ds.modality] if key.startswith("x") else (torch.int64,)
        if tensor.dtype not in wanted:
            fail(f"{attribute} is {tensor.dtype}; {ds.modality} data needs "
                 f"{' or '.join(str(w) for w in wanted)}")
        arrays[key] = tensor.detach().numpy()
    n = ds.num_classes
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 2 <= n <= MAX_CLASSES:
        fail(f"num_classes={n!r} must be an integer in [2, {MAX_CLASSES}]")
    check_arrays(where, arrays, ds.modality, label=FIELDS.get, num_classes=n)
    v = ds.vocab_size
    if v is not None and (ds.modality != "text" or isinstance(v, bool) or not isinstance(
            v, (int, np.integer)) or not 2 <= v <= MAX_CLASSES):
        fail(f"vocab_size={v!r}: text data's vocabulary, an integer in [2, {MAX_CLASSES}] "
             f"(None elsewhere)")
    if ds.modality == "text":  # the LSTM embeds ids in a table of vocab_size rows
        for key in ("x_train", "x_test"):
            low, high = arrays[key].min(), arrays[key].max()
            if low < 0 or high >= (v or n):
                fail(f"{FIELDS[key]} holds token id {low if low < 0 else high}; ids are 0 .. "
                     + (f"vocab_size - 1 = {v - 1}" if v else
                        f"num_classes - 1 = {n - 1} (the lstm embeds ids and predicts over "
                        f"one vocabulary; a Dataset.vocab_size sets another)"))
    _check_statistics(fail, ds)
    if ds.group_names is not None:
        if ds.groups is None:
            fail("group_names is set but groups is None")
        names = ds.group_names
        if not isinstance(names, list) or not all(isinstance(g, str) for g in names):
            fail("group_names must be a list of strings")
        if len(names) <= int(arrays["groups"].max()):
            fail(f"group_names has {len(names)} names but groups uses id "
                 f"{int(arrays['groups'].max())}")
    if ds.test_groups is not None:
        owners = ds.test_groups
        if ds.groups is None or not isinstance(owners, torch.Tensor) or owners.dtype != torch.int64 \
                or owners.shape != ds.test_y.shape:
            fail("test_groups must be an int64 tensor of one natural client per test sample, "
                 "beside groups")
        if len(owners) and not (-1 <= int(owners.min()) and int(owners.max()) <= int(arrays["groups"].max())):
            fail("test_groups holds an id that is no natural client (-1: none)")
    if ds.held_out is not None and (ds.groups is None or ds.held_out.dtype != torch.bool
                                    or ds.held_out.shape != ds.train_y.shape):
        fail("held_out must be a bool tensor of one flag per training sample, beside groups")
    if not isinstance(ds.name, str) or not isinstance(ds.source, str):
        fail("Dataset.name and Dataset.source must be strings (source: where the data came "
             "from)")
    return ds


def _check_statistics(fail, ds) -> None:
    """mean/std: finite numbers, std > 0; for images one per channel (or one for all), as
    the normalisation takes them. Tabular and text data are fed as stored (they say what
    the loader did, e.g. the arrays loader's standardisation)."""
    for field in ("mean", "std"):
        values = getattr(ds, field)
        try:
            numbers = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            numbers = np.array([np.nan])
        if numbers.ndim != 1 or not len(numbers) or not np.isfinite(numbers).all() \
                or (field == "std" and (numbers <= 0).any()):
            fail(f"Dataset.{field}={values!r} must be a tuple of finite numbers"
                 f"{' > 0' if field == 'std' else ''}")
        if ds.modality == "image" and len(numbers) not in (1, ds.train_x.shape[1]):
            fail(f"Dataset.{field} has {len(numbers)} values for {ds.train_x.shape[1]} channels")
