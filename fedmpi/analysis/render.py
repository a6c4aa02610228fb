"""Cells and whole tables as aligned text, Markdown or CSV.

Display cells follow the papers: accuracy in percent with two decimals, ``mean ± std``
(the std left out for a single run), rounds-to-target with how many runs reached it
(``153 ± 12 (2/3)``), virtual hours to a target likewise; a group whose runs share
seeds says so in its count (``3 (1 seed)``). CSV carries the raw numbers
instead, one column per mean, std and count, with accuracies as fractions, so a
spreadsheet or pandas gets exact values.
"""

from __future__ import annotations

import csv
import io
import json
import math

FORMATS = ("text", "csv", "markdown")


def number(x: float, decimals: int | None = None) -> str:
    """Four significant digits without exponent notation (1.646, 183.6, 4000); '-' for NaN
    (not measured), 'inf' and '-inf' for what overflowed."""
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return str(x)
    return f"{x:.{_decimals(x) if decimals is None else decimals}f}"


def _decimals(x: float) -> int:
    if x == 0:
        return 2
    return max(0, min(4, 3 - math.floor(math.log10(abs(x)))))


def stat(mean: float, std: float, percent: bool = False) -> str:
    """``mean ± std`` in one precision; just the mean when the std is undefined."""
    if mean is None or not math.isfinite(mean):
        return number(mean)
    scale = 100.0 if percent else 1.0
    decimals = 2 if percent else _decimals(mean)
    text = number(mean * scale, decimals)
    if std is not None and math.isfinite(std):
        text += f" ± {number(std * scale, decimals)}"
    return text


def rounds_stat(mean: float, std: float, reached: int, n: int) -> str:
    """Rounds to a target over the runs that reached it, and how many did."""
    if not reached:
        return f"- (0/{n})"
    decimals = 0 if float(mean).is_integer() else 1
    text = number(mean, decimals)
    if reached > 1 and math.isfinite(std):
        text += f" ± {number(std, 1)}"
    return f"{text} ({reached}/{n})"


def hours(mean: float, std: float) -> str:
    """Virtual hours as ``mean ± std``: four significant digits however small (a short test
    run lasts seconds, 0.0003061 h), up to 8 decimals; 'inf' for a clock that overflowed."""
    if mean is None or not math.isfinite(mean):
        return number(mean)
    decimals = 2 if mean == 0 else max(0, min(8, 3 - math.floor(math.log10(abs(mean)))))
    text = number(mean, decimals)
    if std is not None and math.isfinite(std):
        text += f" ± {number(std, decimals)}"
    return text


def hours_stat(mean: float, std: float, reached: int, n: int) -> str:
    """Virtual hours to a target over the runs that reached it, and how many did
    (``1.234 ± 0.056 (2/3)``)."""
    if not reached:
        return f"- (0/{n})"
    return f"{hours(mean, std if reached > 1 else math.nan)} ({reached}/{n})"


def runs_count(n: int, seeds: int | None = None, width: int = 0) -> str:
    """The n cell: ``3``, or ``3 (1 seed)`` where runs share seeds (replicas of a seed);
    the count right-aligned in ``width``."""
    count = str(n).rjust(width)
    if seeds is None or seeds >= n:
        return count
    return f"{count} ({seeds} seed{'s' if seeds != 1 else ''})"


def replicas(label: str, n: int, seeds: int) -> str:
    """The note for a group whose runs share seeds: their ± is not a spread over seeds."""
    return (f"{label}: {n} runs, {seeds} distinct seed{'s' if seeds != 1 else ''}: "
            "± is the spread of replicas, not over seeds")


def value(v) -> str:
    """A config value in a table cell: 0.3, fedavg, [4, 8]; '-' when a run lacks the key."""
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return str(v)


def text_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Aligned columns; the first ``left`` columns (labels) left-aligned, numbers right."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A GitHub-flavoured Markdown table; number columns right-aligned."""
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    rule = ["---" if i < left else "---:" for i in range(len(headers))]
    return "\n".join([line(headers), line(rule)] + [line(r) for r in rows])


def csv_table(rows: list[dict], fields: list[str] | None = None) -> str:
    """CSV of row dicts: NaN and None as empty cells, lists and dicts as JSON."""
    fields = fields or list(dict.fromkeys(k for row in rows for k in row))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(fields)
    for row in rows:
        writer.writerow([_csv_value(row.get(f)) for f in fields])
    return out.getvalue()


def _csv_value(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def key_header(key: str, keys: list[str]) -> str:
    """Short column titles: algorithm.name -> algorithm, partition.alpha -> alpha,
    unless two keys would then share a title."""
    def short(k):
        parts = k.split(".")
        return parts[-2] if len(parts) > 1 and parts[-1] == "name" else parts[-1]
    titles = [short(k) for k in keys]
    return short(key) if titles.count(short(key)) == 1 else key
