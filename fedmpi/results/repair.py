"""Results files left behind by a crash: recognise them, read them, copy what survived.

A process killed while it has an HDF5 file open for writing leaves the file's
consistency flags set in its superblock, and HDF5 then refuses to open the file again
(``h5clear -s`` would fix that, but pip does not install it). A file cut short (a full
disk, a copy that stopped) records an end-of-allocation beyond its real end, and a SWMR
reader retries such reads for minutes before it gives up.

So before anyone reads a file, ``inspect`` parses the superblock (versions 2 and 3, what
every fedmpi file has) and compares it with the file's size. ``ReadView`` is a read-only
view of a file whose superblock has the flags cleared (and, for a cut file, the end of
allocation set to the real end, so a read past it fails at once instead of retrying);
h5py opens it as a file object, and the file on disk is never modified. ``salvage``
copies every object that can be read from such a view into a fresh file.
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import h5py

from fedmpi import hdf5

SIGNATURE = b"\x89HDF\r\n\x1a\n"
_HEAD = 12                 # signature, version, size of offsets, size of lengths, flags


@dataclass(frozen=True)
class Superblock:
    version: int
    offset_size: int
    flags: int             # bit 0: open for writing, bit 2: open for SWMR writing
    eoa: int               # end-of-allocation address: where the file should end
    size: int              # the file's real size now

    @property
    def open_for_write(self) -> bool:
        return bool(self.flags & 0b101)

    @property
    def swmr_writing(self) -> bool:
        """A SWMR writer has the file open (or died with it open)."""
        return bool(self.flags & 0b100)

    @property
    def truncated(self) -> bool:
        return self.size < self.eoa


def inspect(path) -> Superblock | None:
    """The superblock of ``path`` (at offset 0, version 2 or 3), or None if it has none we
    read (an older format, a user block, not HDF5): then nothing can be said up front."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_HEAD + 4 * 8 + 4)
        size = os.fstat(f.fileno()).st_size
    if len(head) < _HEAD or head[:8] != SIGNATURE or head[8] not in (2, 3):
        return None
    width = head[9]
    if width not in (2, 4, 8) or len(head) < _HEAD + 4 * width + 4:
        return None
    eoa = int.from_bytes(head[_HEAD + 2 * width:_HEAD + 3 * width], "little")
    return Superblock(head[8], width, head[11], eoa, size)


def damage(path) -> str | None:
    """'truncated to N of M bytes' for a file cut short, else None."""
    sb = inspect(path)
    if sb is not None and sb.truncated:
        return f"truncated to {sb.size:,} of {sb.eoa:,} bytes"
    return None


class ReadView(io.RawIOBase):
    """``path`` read-only, with its superblock's flags cleared and its end of allocation
    no later than the real end; everything else byte for byte. For ``h5py.File(view)``."""

    def __init__(self, path):
        super().__init__()
        self._f = open(path, "rb")
        sb = inspect(path)
        self._patch = b""
        if sb is not None:
            n = _HEAD + 4 * sb.offset_size
            block = bytearray(self._f.read(n))
            block[11] = 0
            eoa = min(sb.eoa, sb.size).to_bytes(sb.offset_size, "little")
            block[_HEAD + 2 * sb.offset_size:_HEAD + 3 * sb.offset_size] = eoa
            self._patch = bytes(block) + struct.pack("<I", lookup3(bytes(block)))
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            offset += os.fstat(self._f.fileno()).st_size
        elif whence == io.SEEK_CUR:
            offset += self._pos
        self._pos = offset
        return offset

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        self._f.seek(self._pos)
        n = self._f.readinto(buffer)
        if self._pos < len(self._patch) and n:
            end = min(len(self._patch), self._pos + n)
            memoryview(buffer)[:end - self._pos] = self._patch[self._pos:end]
        self._pos += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def recorded_writer(path):
    """The root attribute ``writer`` (``fedmpi.results.liveness``) read through a
    ``ReadView``, so even from a file HDF5 would refuse; None if absent or unreadable."""
    try:
        with ReadView(path) as view, h5py.File(view, "r") as f:
            raw = f.attrs.get("writer")
        return json.loads(raw) if raw is not None else None
    except Exception:   # noqa: BLE001 - unreadable means unknown
        return None


def salvage(path, dest, libver) -> list[str]:
    """Copy every object of ``path`` that can be read (through a ``ReadView``) into a new
    file ``dest``; returns the names of the objects that could not be read."""
    lost: list[str] = []
    with ReadView(path) as view, h5py.File(view, "r") as src, \
            hdf5.File(dest, "w", libver=libver) as dst:
        _copy_attrs(src, dst, "/", lost)
        _copy_group(src, dst, "", lost)
    return lost


@dataclass
class Assessment:
    """What a damaged or crashed file still holds: ``lost`` objects, whether its config,
    how many rounds and which checkpoint are readable, and whether a run can go on."""

    lost: list[str]
    config: bool
    rounds: int
    checkpoint: int | None
    resumable: bool

    def summary(self) -> str:
        readable = (["its config"] if self.config else []) + \
            ([f"rounds 1-{self.rounds}"] if self.rounds else []) + \
            ([f"the checkpoint after round {self.checkpoint}"] if self.checkpoint is not None else [])
        lost = ", ".join(self.lost[:4]) + (f" and {len(self.lost) - 4} more" if len(self.lost) > 4 else "")
        return (f"readable: {', '.join(readable) or 'nothing'}"
                + (f"; unreadable: {lost}" if self.lost else ""))


def assess(copy, lost: list[str]) -> Assessment:
    """Judge a ``salvage`` copy: a run can resume from it when everything a resume reads
    survived (the config, the partition, the layout, every column) and at most the
    checkpoint slot that was being written when the writer died is lost."""
    with hdf5.File(copy, "r") as f:
        config = "config" in f.attrs
        columns = [f[g] for g in ("rounds", "clients") if g in f]
        rounds = 0
        if "rounds" in f and "round" in f["rounds"]:
            n = min(ds.shape[0] for ds in f["rounds"].values())
            rounds = int(f["rounds/round"][n - 1]) if n else 0
        current, checkpoint = None, None
        if "checkpoint" in f and "current" in f["checkpoint"].attrs:
            current = f"checkpoint/slot{int(f['checkpoint'].attrs['current'])}"
            if not any(name.startswith(current) for name in lost) and current in f:
                checkpoint = int(f[current].attrs["round"])
        complete = all(json_fields(g) <= set(g) for g in columns) and len(columns) == 2
    spare = [n for n in lost if n.startswith("checkpoint/slot") and not
             (current and n.startswith(current))]
    essential = [n for n in lost if n not in spare]
    needed = config and complete and not essential and (current is None or checkpoint is not None)
    return Assessment(lost, config, rounds, checkpoint, bool(needed))


def json_fields(group) -> set[str]:
    return set(json.loads(group.attrs.get("fields", "[]")))


def _copy_group(src, dst, prefix: str, lost: list[str]) -> None:
    try:
        names = list(src)
    except Exception:   # noqa: BLE001 - any HDF5 error here means "unreadable"
        lost.append(prefix or "/")
        return
    for name in names:
        where = prefix + name
        try:
            obj = src[name]
            if isinstance(obj, h5py.Group):
                group = dst.create_group(name)
                _copy_attrs(obj, group, where, lost)
                _copy_group(obj, group, where + "/", lost)
            else:
                src.copy(obj, dst, name=name)   # reads every chunk: fails on a lost one
        except Exception:   # noqa: BLE001
            if name in dst:
                del dst[name]
            lost.append(where)


def _copy_attrs(src, dst, where: str, lost: list[str]) -> None:
    try:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
    except Exception:   # noqa: BLE001
        lost.append(f"{where} (attributes)")


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``: the checksum HDF5 puts on its metadata."""
    mask = 0xFFFFFFFF

    def rot(x, k):
        return ((x << k) | (x >> (32 - k))) & mask

    length = len(data)
    a = b = c = (0xDEADBEEF + length + initval) & mask
    i = 0
    while length - i > 12:
        a = (a + int.from_bytes(data[i:i + 4], "little")) & mask
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & mask
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & mask
        a = (a - c) & mask; a ^= rot(c, 4); c = (c + b) & mask      # noqa: E702
        b = (b - a) & mask; b ^= rot(a, 6); a = (a + c) & mask      # noqa: E702
        c = (c - b) & mask; c ^= rot(b, 8); b = (b + a) & mask      # noqa: E702
        a = (a - c) & mask; a ^= rot(c, 16); c = (c + b) & mask     # noqa: E702
        b = (b - a) & mask; b ^= rot(a, 19); a = (a + c) & mask     # noqa: E702
        c = (c - b) & mask; c ^= rot(b, 4); b = (b + a) & mask      # noqa: E702
        i += 12
    tail = data[i:]
    if not tail:
        return c
    tail = tail + bytes(12 - len(tail))
    a = (a + int.from_bytes(tail[0:4], "little")) & mask
    b = (b + int.from_bytes(tail[4:8], "little")) & mask
    c = (c + int.from_bytes(tail[8:12], "little")) & mask
    c ^= b; c = (c - rot(b, 14)) & mask     # noqa: E702
    a ^= c; a = (a - rot(c, 11)) & mask     # noqa: E702
    b ^= a; b = (b - rot(a, 25)) & mask     # noqa: E702
    c ^= b; c = (c - rot(b, 16)) & mask     # noqa: E702
    a ^= c; a = (a - rot(c, 4)) & mask      # noqa: E702
    b ^= a; b = (b - rot(a, 14)) & mask     # noqa: E702
    c ^= b; c = (c - rot(b, 24)) & mask     # noqa: E702
    return c
