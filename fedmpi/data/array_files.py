"""Reading the `arrays` dataset's file (.npz or HDF5): its format from the first bytes,
x_train's shape from its header at config time, and every array at load time.

Nothing is allocated before the file is known to hold it: an .npy header inside an .npz
claims a shape, and a damaged (or hostile) one that claims 10^12 rows of a 120-row file
was read as numpy's allocation of terabytes, reported as running out of memory."""

from __future__ import annotations

import hashlib
import math
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedmpi.errors import UsageError

# deferred imports: h5py (and fedmpi.hdf5, which imports it) for an HDF5 arrays file
# alone: ~0.3 s that the .npz and .npy formats do without.

SUFFIXES = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}
_ZIP_MAGIC, _HDF5_MAGIC = b"PK", b"\x89HDF\r\n\x1a\n"


def _fail(where, message):
    raise UsageError(f"{where}: {message}")


def _open_check(file: Path) -> str:
    """The file's format, after reading its first bytes: readable, and what it claims."""
    kind = SUFFIXES[file.suffix.lower()]
    try:
        with open(file, "rb") as f:
            head = f.read(8)
    except OSError as err:
        _fail(file, f"cannot be read ({err.strerror or err})")
    if kind == "npz" and not zipfile.is_zipfile(file):
        _fail(file, "not an .npz file (not a zip archive of .npy arrays, as numpy.savez writes)")
    if kind == "hdf5" and head != _HDF5_MAGIC:
        import h5py
        if not h5py.is_hdf5(file):  # also HDF5 behind a user block
            _fail(file, "not an HDF5 file (no HDF5 signature)")
    return kind


def x_train_header(file: Path) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of x_train without reading the array."""
    if _open_check(file) == "npz":
        try:
            with zipfile.ZipFile(file) as archive:
                names = archive.namelist()
                if "x_train.npy" not in names:
                    _missing(file, "x_train", [n.removesuffix(".npy") for n in names])
                return _npy_header(file, archive, "x_train.npy")
        except UsageError:
            raise
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
            _fail(file, f"array 'x_train' cannot be read ({_one_line(err)})")
    import h5py

    from fedmpi import hdf5
    try:
        with hdf5.File(file, "r") as f:
            if "x_train" not in f:
                _missing(file, "x_train", list(f))
            node = f["x_train"]
            if not isinstance(node, h5py.Dataset):
                _fail(file, "'x_train' is an HDF5 group; the arrays are datasets at the top level")
            return tuple(node.shape), node.dtype
    except UsageError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError) as err:
        _fail(file, f"not a readable HDF5 file ({_one_line(err)})")


def _npy_header(file: Path, archive: zipfile.ZipFile, member: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an .npy member of the archive claims, checked against the bytes
    the member holds (numpy allocates the claimed size before it reads a byte)."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(f)
        start = f.tell()
    shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
    if not dtype.hasobject:   # object arrays are pickles: refused when read
        claimed = math.prod(shape) * dtype.itemsize   # Python ints: no overflow
        held = archive.getinfo(member).file_size - start
        if claimed != held:
            key = member.removesuffix(".npy")
            _fail(file, f"array {key!r} is damaged: its header claims shape {shape} of "
                        f"{dtype} ({_size(claimed)}) but the file holds {_size(held)} of it; "
                        f"is data.path a complete copy?")
    return shape, dtype


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _missing(where, key, present) -> None:
    _fail(where, f"no array {key!r}; the file must hold x_train, y_train, x_test, y_test "
                 f"(it holds: {', '.join(sorted(present)) or 'nothing'})")


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def read_arrays(file: Path) -> dict[str, np.ndarray]:
    """Every top-level array of the file by name; object arrays (pickles) are refused."""
    if _open_check(file) == "npz":
        return _read_npz(file)
    return _read_hdf5(file)


def _read_npz(file: Path) -> dict[str, np.ndarray]:
    out = {}
    try:
        with zipfile.ZipFile(file) as archive:
            names = archive.namelist()
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:   # numpy reads one of them, silently
                _fail(file, f"holds the array {twice[0].removesuffix('.npy')!r} twice (two "
                            f"members of one name in the zip); each array once")
            for member in names:
                if member.endswith(".npy"):
                    try:
                        _npy_header(file, archive, member)
                    except UsageError:
                        raise
                    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
                        _fail(file, f"array {member.removesuffix('.npy')!r} cannot be read "
                                    f"({_one_line(err)})")
        with np.load(file, allow_pickle=False) as npz:
            for key in npz.files:
                try:
                    out[key] = npz[key]
                except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
                    if "pickle" in str(err):
                        _fail(file, f"array {key!r} holds Python objects (a pickle); fedmpi "
                                    f"reads numbers, and strings for group_names")
                    _fail(file, f"array {key!r} cannot be read ({_one_line(err)})")
    except UsageError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
        _fail(file, f"not a readable .npz file ({_one_line(err)})")
    return out


def _read_hdf5(file: Path) -> dict[str, np.ndarray]:
    import h5py

    from fedmpi import hdf5

    out = {}
    try:
        with hdf5.File(file, "r") as f:
            for key in f:
                node = f[key]
                if not isinstance(node, h5py.Dataset):
                    _fail(file, f"{key!r} is an HDF5 group; the arrays are datasets at the "
                                f"top level")
                try:
                    string = h5py.check_string_dtype(node.dtype) is not None
                    out[key] = np.asarray(node.asstr()[()] if string else node[()])
                except (OSError, KeyError, RuntimeError, ValueError, TypeError) as err:
                    _fail(file, f"array {key!r} cannot be read ({_one_line(err)})")
    except UsageError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError) as err:
        _fail(file, f"not a readable HDF5 file ({_one_line(err)})")
    return out


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


