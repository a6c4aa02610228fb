"""Words for the word-level text benchmarks: LEAF's Sent140 (fedmpi.data.leaf) and TFF's
StackOverflow (fedmpi.data.tff).

- LEAF's tokens (models/utils/language_utils.py ``split_line``): runs of word characters
  and apostrophes, and each of ``. , ! ? ;`` on its own; the case is kept. LEAF's ids
  (``line_to_indices``): a word's position in the vocabulary, ``len(vocab)`` for a word
  outside it and for the padding after the first ``max_words`` tokens.
- LEAF's vocabulary is GloVe's, from its ``embs.json`` (``{"vocab": [...], "emba":
  [...]}``, made by models/sent140/get_embs.sh); without it fedmpi builds one from the
  training tweets: the ``size`` most frequent tokens, ties by the token.
- TFF's StackOverflow vocabulary is the first ``size`` lines (most frequent first) of its
  ``stackoverflow.word_count`` file, ``word count`` a line (TFF's load_word_counts); the
  ids are TFF's word-prediction ones (tff.simulation.baselines.stackoverflow): 0 the
  padding, 1..V the words, V + 1 out of vocabulary (one bucket), V + 2 the beginning and
  V + 3 the end of a post.

Every problem with a vocabulary file is one line naming the file.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from fedmpi.errors import UsageError

_LEAF_TOKEN = re.compile(r"[\w']+|[.,!?;]")


def leaf_tokens(line: str) -> list[str]:
    """LEAF's split_line: the tokens of a tweet."""
    return _LEAF_TOKEN.findall(line)


def id_dtype(vocab_size: int):
    """The smallest integer dtype holding ids 0 .. vocab_size - 1 (uint8 for characters)."""
    return np.uint8 if vocab_size <= 256 else np.int16 if vocab_size <= 2 ** 15 else np.int32


def built_vocabulary(lines, size: int) -> list[str]:
    """The ``size`` most frequent LEAF tokens of ``lines``, the most frequent first and
    ties by the token (a fixed order: the same ids on every rank and every run)."""
    counts = Counter(t for line in lines for t in leaf_tokens(line))
    return [w for w, _ in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[:size]]


def leaf_vocabulary(path: Path) -> list[str]:
    """The ``vocab`` list of LEAF's embs.json (GloVe's words, in GloVe's order)."""
    try:
        with open(path, "rb") as f:
            embs = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"vocabulary file {path} cannot be read as LEAF's embs.json "
                         f"({exc})") from None
    vocab = embs.get("vocab") if isinstance(embs, dict) else None
    if not isinstance(vocab, list) or not vocab or not all(isinstance(w, str) for w in vocab) \
            or len(set(vocab)) != len(vocab):
        raise UsageError(f"vocabulary file {path}: LEAF's embs.json holds \"vocab\", a list of "
                         f"distinct words")
    return vocab


def leaf_ids(lines, vocab: list[str], max_words: int) -> np.ndarray:
    """LEAF's line_to_indices for every line: [len(lines), max_words] ids."""
    index = {w: i for i, w in enumerate(vocab)}
    unknown = len(vocab)
    out = np.full((len(lines), max_words), unknown, dtype=id_dtype(len(vocab) + 1))
    for row, line in enumerate(lines):
        ids = [index.get(t, unknown) for t in leaf_tokens(line)[:max_words]]
        out[row, :len(ids)] = ids
    return out


def tff_vocabulary(path: Path, size: int) -> list[str]:
    """The first ``size`` words of TFF's stackoverflow.word_count (``word count`` lines)."""
    words: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                parts = line.split()
                if len(parts) != 2 or not parts[1].isdigit():
                    raise UsageError(f"vocabulary file {path}: line {number} is not 'word "
                                     f"count' (TFF's stackoverflow.word_count)")
                words.append(parts[0])
                if len(words) == size:
                    break
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"vocabulary file {path} cannot be read ({exc})") from None
    if len(set(words)) != len(words):
        raise UsageError(f"vocabulary file {path}: a word is listed twice")
    if len(words) < size:
        raise UsageError(f"vocabulary file {path} lists {len(words)} words; data.vocab_size "
                         f"asks for {size}")
    return words


def tff_special(vocab_size: int) -> dict[str, int]:
    """TFF's special ids for a vocabulary of ``vocab_size`` words and one OOV bucket."""
    return {"pad": 0, "oov": vocab_size + 1, "bos": vocab_size + 2, "eos": vocab_size + 3}


def tff_post_ids(tokens: str, index: dict[str, int], max_words: int) -> np.ndarray:
    """TFF's to_ids: [bos, the first max_words words (+1; OOV V + 1), eos if fewer]."""
    v = len(index)
    special = tff_special(v)
    words = tokens.split(" ")[:max_words]   # tf.strings.split(sep=" "): "" is a token too
    ids = [special["bos"]] + [index.get(w, special["oov"] - 1) + 1 for w in words]
    if len(words) < max_words:
        ids.append(special["eos"])
    return np.asarray(ids, dtype=np.int64)


def next_word_windows(ids: np.ndarray, max_words: int) -> tuple[np.ndarray, np.ndarray]:
    """A post's TFF next-word targets as windows: for each position j >= 1 of ``ids``
    (len <= max_words + 1), the ids before it right-padded with 0 to ``max_words``
    ([L - 1, max_words]) and ids[j]. An LSTM read after each window's last id (model
    option pad_id = 0) makes exactly the prediction TFF's masked sequence model makes at
    position j - 1."""
    row = np.zeros(max_words, dtype=np.int64)
    row[:min(len(ids), max_words)] = ids[:max_words]
    x = np.tril(np.broadcast_to(row, (len(ids) - 1, max_words)))
    return x, ids[1:]
