"""The `arrays` dataset: your own data in one .npz or HDF5 file, and no code.

``data.dataset = "arrays"`` with ``data.path`` = a ``.npz`` (numpy.savez) or HDF5
(``.h5``, ``.hdf5``) file of arrays ``x_train``, ``y_train``, ``x_test``, ``y_test``, and
optionally ``groups`` (int natural-client id per training sample; then
``partition.kind = "natural"`` works), ``group_names`` (strings, group k's name),
``num_classes`` and ``vocab_size`` (integer scalars). Rules (docs/datasets.md):

- modality from x_train, read from the file's header at config time: 3-D or 4-D arrays
  are images, 2-D float (or bool) arrays tabular features, 2-D integer arrays text token
  ids; ``data.modality`` overrides it (integer features: ``"tabular"``).
- images: [N, H, W] (one channel), or 4-D with the channel axis where the size is 1 or 3:
  axis 1 (NCHW) if it is 1 or 3 and the last axis is not, the last axis (NHWC) if it is
  1 or 3 and axis 1 is not; otherwise ``data.layout = "nchw" | "nhwc"`` says, and then
  any channel count goes. Square only. uint8 is kept; other integers must be 0..255;
  floats must be in [0, 1] and are quantised to uint8 (round(255 x)): every image fedmpi
  trains on is bytes, normalised with per-channel statistics on the device.
- tabular: float32, standardised per feature with the training set's mean and std (a
  constant feature: std 1); they are the Dataset's mean/std. No augmentation.
- text: ids >= 0; the vocabulary is the largest id + 1 (or vocab_size); the LSTM
  embeds and predicts over one table, so num_classes = max(vocabulary, classes).
- labels: integers >= 0 (integral floats are accepted); num_classes = largest label + 1
  over train and test (or num_classes), at least 2, at most 2**20.

`from_arrays` is the same conversion for arrays in memory: a plugin loader may return
``from_arrays({...}, where=..., name=...)``. Every problem is a one-line UsageError
naming the file and the array; none of it runs code from the file (no pickles).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from fedmpi.data.array_files import SUFFIXES, _fail, _missing, read_arrays, sha256, x_train_header
from fedmpi.data.registry import MAX_CLASSES, MODALITIES, check_arrays, register
from fedmpi.data.sources import Dataset, _tensor, channel_stats
from fedmpi.errors import UsageError

REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("groups", "group_names", "num_classes", "vocab_size")
LAYOUTS = ("auto", "nchw", "nhwc")
HINT = ("your own .npz or HDF5 file: data.path = FILE with x_train, y_train, x_test, y_test "
        "(docs/datasets.md)")


# --- config-time: the file and the modality, from the header ------------------------------


def _file(path) -> Path:
    """data.path as a file that exists, with a suffix that says its format."""
    if path is None:
        raise UsageError("config field data.path: dataset 'arrays' needs data.path = an .npz or "
                         "HDF5 (.h5, .hdf5) file with arrays x_train, y_train, x_test, y_test")
    if not isinstance(path, str) or not path:
        raise UsageError(f"config field data.path: expected a file path (a string), got {path!r}")
    file = Path(path).expanduser()
    if file.is_dir():
        raise UsageError(f"config field data.path: {path} is a directory; give the .npz or "
                         f"HDF5 file")
    if file.suffix.lower() not in SUFFIXES:
        raise UsageError(f"config field data.path: {path} is not an .npz or HDF5 file name "
                         f"(.npz, .h5, .hdf5)")
    if not file.exists():   # the absolute path: a relative one says nothing of where it looked
        raise UsageError(f"config field data.path: {file.absolute()} does not exist")
    if not file.is_file():   # a link to /dev/zero: np.load read it until the node ran out
        raise UsageError(f"config field data.path: {path} is not a regular file (a device, "
                         f"a pipe or a socket); give the .npz or HDF5 file")
    return file


def _choice(field: str, value, allowed) -> str:
    if value not in allowed:
        raise UsageError(f"config field data.{field}: {value!r} is not allowed; choose one of "
                         f"{', '.join(allowed)}")
    return value


def detect(where, shape: tuple, dtype: np.dtype, modality: str = "auto",
           layout: str = "auto") -> str:
    """The modality of x_train from its shape and dtype (the rules above); checks that a
    forced ``modality`` and ``layout`` fit them, and the channel axis of 4-D images."""
    label = "array 'x_train'"
    if dtype.kind not in "biuf":
        _fail(where, f"{label} has dtype {_dtype(dtype)}; inputs are numbers (uint8 images, "
                     f"float features or integer token ids)")
    rank = len(shape)
    if modality == "auto":
        if rank not in (2, 3, 4):
            _fail(where, f"{label} has shape {shape}; expected [N, F] features or [N, T] token ids "
                         f"(2-D), or images [N, H, W], [N, C, H, W], [N, H, W, C]")
        modality = "image" if rank > 2 else "text" if dtype.kind in "iu" else "tabular"
    elif modality == "image" and rank not in (3, 4):
        _fail(where, f"{label} has shape {shape}; images are [N, H, W], [N, C, H, W] or "
                     f"[N, H, W, C]")
    elif modality in ("text", "tabular") and rank != 2:
        _fail(where, f"{label} has shape {shape}; {modality} inputs are 2-D, "
                     f"{'[N, T] token ids' if modality == 'text' else '[N, F] features'}")
    if modality == "text" and dtype.kind not in "iu":
        _fail(where, f"{label} has dtype {_dtype(dtype)}; text inputs are integer token ids")
    if modality == "image" and dtype.kind == "b":
        _fail(where, f"{label} has dtype bool; images are uint8 0..255 or floats in [0, 1]")
    if layout != "auto" and rank != 4:
        raise UsageError(f"config field data.layout: {layout!r} says where the channel axis of "
                         f"4-D images is; {label} in {where} has shape {shape}")
    if modality == "image" and rank == 4:
        channel_axis(where, shape, layout)
    return modality


def channel_axis(where, shape: tuple, layout: str = "auto") -> str:
    """"nchw" or "nhwc" for 4-D images: ``layout`` if given, else the axis of size 1 or 3."""
    if layout != "auto":
        return layout
    first, last = shape[1] in (1, 3), shape[3] in (1, 3)
    if first != last:
        return "nchw" if first else "nhwc"
    why = ("axis 1 and the last axis both could be" if first else
           "neither axis 1 nor the last axis has size 1 or 3 (grey or RGB), so neither is")
    _fail(where, f"array 'x_train' has shape {shape}: {why} the channel axis; set data.layout = "
                 f"\"nchw\" or \"nhwc\"")


def _dtype(dtype: np.dtype) -> str:
    return "object (Python objects)" if dtype.kind == "O" else str(dtype)


def arrays_modality(data_dir=None, path=None, modality="auto", layout="auto") -> str:
    """Config time: the modality of the file's x_train, from its header only."""
    _choice("modality", modality, ("auto",) + MODALITIES)
    _choice("layout", layout, LAYOUTS)
    file = _file(path)
    shape, dtype = x_train_header(file)
    return detect(file, shape, dtype, modality, layout)


# --- load time ----------------------------------------------------------------------------


@register("arrays", modality=arrays_modality,
          locate=lambda data_dir: "any .npz or HDF5 file you name with data.path", hint=HINT)
def load_arrays(data_dir=None, seed=0, path=None, modality="auto", layout="auto") -> Dataset:
    """Your own dataset from the .npz or HDF5 file ``path`` (data.path); see the module
    docstring for the arrays and rules. ``modality`` ("auto", "image", "text",
    "tabular") and ``layout`` ("auto", "nchw", "nhwc") override the detection. data_dir is
    not used. The source recorded in the results file is the file's absolute path and the
    sha256 of its bytes, so a results file says which data ran."""
    _choice("modality", modality, ("auto",) + MODALITIES)
    _choice("layout", layout, LAYOUTS)
    file = _file(path)
    arrays = read_arrays(file)
    try:
        source = f"{file.resolve()} sha256:{sha256(file)}"
    except OSError as err:
        _fail(file, f"cannot be read ({err.strerror or err})")
    return from_arrays(arrays, file, name="arrays", modality=modality, layout=layout, source=source)


def from_arrays(arrays: Mapping[str, np.ndarray], where, *, name: str = "arrays",
                modality: str = "auto", layout: str = "auto", source: str | None = None) -> Dataset:
    """A checked `Dataset` from numpy arrays named as in an arrays file (x_train, y_train,
    x_test, y_test, optional groups, group_names, num_classes, vocab_size), by the rules
    of this module; ``where`` (a path, or what your loader read) starts every message."""
    a = dict(arrays)
    for key in REQUIRED:
        if key not in a:
            _missing(where, key, a)
    unknown = sorted(set(a) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        _fail(where, f"array {unknown[0]!r} is not one fedmpi reads; allowed: "
                     f"{', '.join(REQUIRED + OPTIONAL)}")
    for key, value in a.items():
        _check_kind(where, key, value)
    x_train, x_test = a["x_train"], a["x_test"]
    modality = detect(where, x_train.shape, x_train.dtype, modality, layout)
    if x_test.shape[1:] != x_train.shape[1:]:
        _fail(where, f"array 'x_test' holds samples of shape {x_test.shape[1:]} but 'x_train' "
                     f"{x_train.shape[1:]}; train and test must match")
    if modality == "image":
        order = channel_axis(where, x_train.shape, layout) if x_train.ndim == 4 else None
        x_train, x_test = (_nchw(x, order) for x in (x_train, x_test))
    groups = a.get("groups")
    shaped = {"x_train": x_train, "y_train": a["y_train"], "x_test": x_test, "y_test": a["y_test"]}
    check_arrays(where, shaped if groups is None else dict(shaped, groups=groups), modality)
    y_train, y_test = (_labels(where, key, a[key]) for key in ("y_train", "y_test"))
    num_classes = _count(where, a, "num_classes", "the labels", y_train, y_test)
    if modality == "text":
        x_train, x_test = _ids(where, "x_train", x_train), _ids(where, "x_test", x_test)
        num_classes = max(num_classes, _count(where, a, "vocab_size", "the token ids",
                                              x_train, x_test))
    elif "vocab_size" in a:
        _fail(where, f"array 'vocab_size' is for text (token ids); x_train holds {modality} data")
    if num_classes < 2:
        _fail(where, "arrays 'y_train' and 'y_test' hold class 0 only; classification needs "
                     "at least 2 classes (or set array 'num_classes')")
    group_names = _group_names(where, a.get("group_names"), groups)
    if groups is not None:
        groups = _tensor(groups, np.int64)
    source = source if source is not None else str(where)
    if modality == "image":
        train, test = (_tensor(_pixels(where, key, x), np.uint8)
                       for key, x in (("x_train", x_train), ("x_test", x_test)))
        mean, std = channel_stats(train)
        std = tuple(s if s > 0 else 1.0 for s in std)  # a constant channel: no division by 0
    elif modality == "text":
        ids = np.uint8 if num_classes <= 256 else np.int32
        train, test, mean, std = _tensor(x_train, ids), _tensor(x_test, ids), (0.0,), (1.0,)
    else:
        train, test, mean, std = _standardise(where, x_train, x_test)
    return Dataset(name, train, _tensor(y_train, np.int64), test, _tensor(y_test, np.int64),
                   num_classes, mean, std, source, modality=modality, groups=groups,
                   group_names=group_names)


def _check_kind(where, key: str, value) -> None:
    """Numbers only (strings for group_names); scalars where a count belongs."""
    if not isinstance(value, np.ndarray):
        _fail(where, f"array {key!r} is a {type(value).__name__}, not a numpy array")
    kind = value.dtype.kind
    if key == "group_names":
        if kind not in "USO":
            _fail(where, f"array 'group_names' has dtype {value.dtype}; it holds strings")
        return
    if kind == "c":
        _fail(where, f"array {key!r} is complex ({value.dtype}); fedmpi takes real numbers")
    if kind not in "biuf":
        _fail(where, f"array {key!r} has dtype {_dtype(value.dtype)}; fedmpi takes numbers")
    if key == "groups" and kind not in "iu":
        _fail(where, f"array 'groups' has dtype {value.dtype}; natural-client ids are integers")
    if key in ("num_classes", "vocab_size") and value.size != 1:
        _fail(where, f"array {key!r} has shape {value.shape}; it is one integer")


def _count(where, a, key: str, what: str, train, test) -> int:
    """Largest value of train and test + 1, or the file's scalar `key` when it says more."""
    count = int(max(train.max(), test.max())) + 1
    if key not in a:
        return count
    given = _scalar(where, key, a[key])
    if given < count:
        _fail(where, f"array {key!r} is {given} but {what} go up to {count - 1}")
    return given


def _scalar(where, key: str, value: np.ndarray) -> int:
    number = value.reshape(-1)[0]
    if value.dtype.kind not in "iu" or not 2 <= number <= MAX_CLASSES:
        _fail(where, f"array {key!r} is {number!r}; it must be an integer in [2, {MAX_CLASSES}]")
    return int(number)


def _nchw(x: np.ndarray, order: str | None) -> np.ndarray:
    """Images as [N, C, H, W]: a channel axis for [N, H, W], NHWC transposed."""
    if order is None:
        return x[:, None]
    return x.transpose(0, 3, 1, 2) if order == "nhwc" else x


def _labels(where, key: str, y: np.ndarray) -> np.ndarray:
    """Class ids as int64: integers (or bool), or floats that are whole numbers."""
    if y.dtype.kind == "f":
        bad = ~np.isfinite(y) | (y != np.floor(y))
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            _fail(where, f"array {key!r} holds labels that are not integers (e.g. "
                         f"{y[first].item()} at index {first}); labels are class ids 0, 1, ...")
    if y.max() >= MAX_CLASSES:
        _fail(where, f"array {key!r} holds label {y.max()}; fedmpi takes at most {MAX_CLASSES} "
                     f"classes (labels 0 .. {MAX_CLASSES - 1})")
    return y.astype(np.int64)


def _ids(where, key: str, x: np.ndarray) -> np.ndarray:
    if x.dtype.kind not in "iu":
        _fail(where, f"array {key!r} has dtype {x.dtype}; text inputs are integer token ids")
    if x.min() < 0 or x.max() >= MAX_CLASSES:
        _fail(where, f"array {key!r} holds token id {x.min() if x.min() < 0 else x.max()}; ids "
                     f"are 0 .. {MAX_CLASSES - 1}")
    return x.astype(np.int64)


def _pixels(where, key: str, x: np.ndarray) -> np.ndarray:
    """uint8 pixels: integers in 0..255 as they are, floats in [0, 1] as round(255 x)."""
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind == "b":
        _fail(where, f"array {key!r} has dtype bool; images are uint8 0..255 or floats in [0, 1]")
    if x.dtype.kind == "f":
        if not np.isfinite(x).all():
            _fail(where, f"array {key!r} holds NaN or infinite pixels")
        if x.min() < 0 or x.max() > 1:
            _fail(where, f"array {key!r} holds float pixels outside [0, 1] (min {x.min():g}, "
                         f"max {x.max():g}); store uint8 0..255 or floats in [0, 1]")
        return np.rint(x.astype(np.float64) * 255).astype(np.uint8)
    if x.min() < 0 or x.max() > 255:
        _fail(where, f"array {key!r} holds integer pixels outside 0..255 (min {x.min()}, "
                     f"max {x.max()})")
    return x.astype(np.uint8)


def _standardise(where, x_train: np.ndarray, x_test: np.ndarray):
    """float32 features minus the train mean, over the train std (1 where it is 0)."""
    train, test = x_train.astype(np.float64), x_test.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = train.mean(0), train.std(0)
        bad = ~(np.isfinite(mean) & np.isfinite(std))
        if bad.any():
            _fail(where, f"array 'x_train' feature {int(np.flatnonzero(bad)[0])} is too large to "
                         f"standardise (its mean or std overflows float64)")
        std[std == 0] = 1.0
        train, test = ((x - mean) / std for x in (train, test))
        train, test = train.astype(np.float32), test.astype(np.float32)
    if not np.isfinite(test).all():
        i, j = np.argwhere(~np.isfinite(test))[0]
        _fail(where, f"array 'x_test' feature {j} (sample {i}) is beyond float32 range after "
                     f"standardising with the training set's mean and std")
    return (torch.from_numpy(train), torch.from_numpy(test), tuple(mean.tolist()),
            tuple(std.tolist()))


def _group_names(where, names, groups) -> list[str] | None:
    if names is None:
        return None
    if groups is None:
        _fail(where, "array 'group_names' names the groups, but there is no array 'groups'")
    if names.ndim != 1:
        _fail(where, f"array 'group_names' has shape {names.shape}; it is 1-D, name k for group k")
    out = []
    for item in names.tolist():
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                _fail(where, "array 'group_names' holds bytes that are not UTF-8")
        if not isinstance(item, str):
            _fail(where, f"array 'group_names' holds {type(item).__name__}; it holds strings")
        out.append(item)
    top = int(groups.max())
    if len(out) <= top:
        _fail(where, f"array 'group_names' has {len(out)} names but 'groups' uses id {top}")
    return out
