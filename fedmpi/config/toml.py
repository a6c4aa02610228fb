"""A resolved config back to TOML, by ``tomli_w``: ``to_toml`` for a whole config
(``fedmpi config``), ``toml_value`` for one value on a command line (``--set KEY=VALUE``).

TOML has no null: a None value (``data.data_dir``, ``system.state_dir`` when unset) is
left out, at any depth, and so reads back as the field's default, None. A table inside a
section (FNR-FL's ``base_params``) is written as a sub-table, ``[algorithm.base_params]``.
"""

from __future__ import annotations

import tomli_w


def to_toml(values: dict) -> str:
    """The resolved config as TOML that ``fedmpi run FILE`` reads back to the same config."""
    return _one_line_arrays(tomli_w.dumps(_without_none(values), indent=0))


def toml_value(value) -> str:
    """A Python value as a TOML literal on one line (what TOML files and ``--set`` read
    back): scalars and keys as tomli_w writes them, arrays ``[a, b]``, tables ``{k = v}``."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(v)}"
                               for k, v in _without_none(value).items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def _key(key: str) -> str:
    """A key, bare when it can be and quoted when not (``"a.b"``)."""
    return tomli_w.dumps({key: 0}).removesuffix(" = 0\n")


def _one_line_arrays(text: str) -> str:
    """tomli_w lays out a non-empty array one item per line; with indent=0 and no multiline
    strings those are its only raw newlines inside a value (a string's are escaped, and no
    other line ends in "[" or ","): joined back into ``[a, b]``."""
    return text.replace("[\n", "[").replace(",\n]", "]").replace(",\n", ", ")


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value
