"""Methods x settings, as FedMRUR Tables 2/3 and FedACG Table 1 lay out their results.

Rows are the values of one config key (the algorithm), columns the settings (the values
of the other keys that differ between the runs, e.g. partition.alpha or clients.num),
and each setting has one sub-column per metric: final accuracy (or accuracy at --at
rounds, FedACG's 500R/1000R), optionally EMA-smoothed, and rounds to each --target
accuracy (FedMRUR). Cells are mean ± std over the seeds; a cell whose runs share seeds
(replicas) is named under the table, as are the config keys the runs also differ in
besides rows and settings (``also differ: ...``; on stderr with --format csv). Only
completed runs are used; any others are named on stderr.

    python tools/paper_table.py runs/sweep --target 0.8 --format markdown
    python tools/paper_table.py runs/ --setting partition.alpha --at 500 --at 1000 --smooth 0.9
    python tools/paper_table.py runs/reproductions --paper fedacg

``--paper NAME`` (fedacg, fedmrur, fedmim, fnrfl, fedu2) lays the runs out as that seed
paper's main table (fedmpi.analysis.papers): its method names as rows, its settings as
columns, its metrics per column (FedACG: EMA(0.9) accuracy at 500/1000 rounds and rounds
to its targets; FedU^2: kNN, linear probe, 1%/10% fine-tuning), and the paper's own
number in brackets beside ours wherever the runs are in a setting the paper reports.

Thin over fedmpi.analysis: group_table + pivot + render.
"""

from __future__ import annotations

import click

from fedmpi.analysis import differing_keys, group_table, papers, pivot, render
from fedmpi.analysis.cli import load_runs, parse_rounds, parse_smooth, parse_targets
from fedmpi.analysis.metrics import target_name
from fedmpi.analysis.report import confound_line
from fedmpi.analysis.tables import check_keys
from fedmpi.errors import UsageError, one_line_errors


@click.command()
@click.argument("sources", nargs=-1, required=True, metavar="FILES_OR_DIRS...")
@click.option("--rows", "row_key", default="algorithm.name", metavar="KEY",
              help="Config key whose values are the rows (default algorithm.name).")
@click.option("--setting", multiple=True, metavar="KEY",
              help="Config key(s) whose values are the columns (default: every key that differs).")
@click.option("--metric", default="final", metavar="final|best",
              help="Accuracy shown when no --at is given (default final).")
@click.option("--at", multiple=True, metavar="ROUND", help="Accuracy at this round (repeatable).")
@click.option("--target", multiple=True, metavar="ACC", help="Rounds to this accuracy, 0.8 or 80%.")
@click.option("--smooth", metavar="BETA", help="EMA-smoothed accuracy, e.g. 0.9 (FedACG).")
@click.option("--format", "fmt", default="text", metavar="text|markdown|csv")
@click.option("--strict", is_flag=True, help="Fail on a file that is not a fedmpi results file.")
@click.option("--paper", metavar="NAME", help="A seed paper's table layout: " + ", ".join(papers.LAYOUTS))
@one_line_errors
def main(sources, row_key, setting, metric, at, target, smooth, fmt, strict, paper):
    """Print a methods x settings table of the runs in FILES_OR_DIRS."""
    if fmt not in render.FORMATS:
        raise UsageError(f"--format {fmt!r}: allowed are {', '.join(render.FORMATS)}")
    if metric not in ("final", "best"):
        raise UsageError(f"--metric {metric!r}: allowed are final, best")
    layout = papers.layout(paper) if paper else None
    runs = _completed(load_runs(sources, strict, False))
    if layout is not None:
        settings = check_keys(runs, setting, "--setting") if setting else None
        smoothing = parse_smooth(smooth) if smooth else None
        _paper(runs, layout, settings, parse_rounds(at), parse_targets(target), smoothing, fmt)
        return
    check_keys(runs, [row_key], "--rows")
    settings = check_keys(runs, setting, "--setting") if setting else \
        [k for k in differing_keys(runs) if k != row_key]
    at, targets = parse_rounds(at), parse_targets(target)
    rows = group_table(runs, [row_key] + settings, at, targets, parse_smooth(smooth))
    labels, columns, cells = pivot(rows, row_key, settings)
    metrics = [f"acc@{r}" for r in at] or [f"{metric}_acc"]
    metrics += [f"rounds_to_{target_name(t)}" for t in targets]
    also = confound_line(runs, [row_key] + settings)
    if fmt == "csv":
        click.echo(render.csv_table(_csv_rows(labels, columns, cells, row_key, settings, metrics)), nl=False)
        if also:   # the CSV stays a table a program reads
            for line in also.splitlines():
                click.echo(f"paper_table: {line}", err=True)
        return
    headers = [render.key_header(row_key, [row_key])] + [
        _setting_title(s, settings) + f" {_metric_title(m)}" for s in columns for m in metrics]
    body = [[render.value(label)] + [_cell(cells.get((label, s)), m) for s in columns for m in metrics]
            for label in labels]
    layout = render.markdown_table if fmt == "markdown" else render.text_table
    notes = ([also] if also else []) + _notes(labels, columns, cells, settings, smooth)
    click.echo(layout(headers, body) + "\n\n" + "\n".join(notes))


def _paper(runs, layout, settings, at, targets, smooth, fmt):
    """The runs as the paper lays out its table, the paper's numbers in brackets."""
    table = papers.paper_table(runs, layout, settings, at, targets, smooth)
    kept = {c: [m for m in table.metrics[c] if _shown(table, c, m)] or ["final_acc"]
            for c in table.columns}
    also = confound_line(runs, table.method_keys + table.settings)
    if fmt == "csv":
        out = []
        for label in table.rows:
            row = {"method": label}
            for c in table.columns:
                title, cell = _setting_title(c, table.settings), table.cells.get((label, c))
                row[f"{title} n"] = cell["n"] if cell else None
                for m in kept[c]:
                    row[f"{title} {m}_mean"] = (cell or {}).get(f"{m}_mean")
                    row[f"{title} {m}_std"] = (cell or {}).get(f"{m}_std")
                    row[f"{title} {m}_paper"] = papers.paper_value(table.blocks[c], label, m)
            out.append(row)
        click.echo(render.csv_table(out), nl=False)
        if also:
            for line in also.splitlines():
                click.echo(f"paper_table: {line}", err=True)
        return
    headers = ["method"] + [f"{_setting_title(c, table.settings)} {_metric_title(m)}"
                            for c in table.columns for m in kept[c]]
    body = [[label] + [_paper_cell(table, label, c, m) for c in table.columns for m in kept[c]]
            for label in table.rows]
    layout_fn = render.markdown_table if fmt == "markdown" else render.text_table
    smoothing = layout.smooth if smooth is None else smooth
    notes = [layout.title] + ([also] if also else [])
    notes.append(f"mean ± std over seeds; accuracy in %{f', EMA({smoothing:g})' if smoothing else ''}; "
                 "[x]: the paper's own number in the same setting")
    for c in table.columns:
        where = _setting_title(c, table.settings)
        sources = ", ".join(b.source for b in table.blocks[c])
        notes.append(f"{where}: " + (f"paper numbers from {sources}" if sources else
                                     "the paper reports no number in this setting"))
    click.echo(layout_fn(headers, body) + "\n\n" + "\n".join(notes))


def _shown(table, column, metric) -> bool:
    """A metric no run of the column has (acc@1000 of 500-round runs) is left out, unless
    the paper has a number for it there."""
    if any(papers.paper_value(table.blocks[column], label, metric) is not None for label in table.rows):
        return True
    key = f"{metric}_reached" if metric.startswith("rounds_to_") else f"{metric}_mean"
    return any((cell := table.cells.get((label, column))) and cell.get(key) is not None and
               cell[key] == cell[key] for label in table.rows)


def _paper_cell(table, label, column, metric) -> str:
    cell = table.cells.get((label, column))
    ours = _cell(cell, metric) if cell and f"{metric}_mean" in cell else "-"
    theirs = papers.paper_value(table.blocks[column], label, metric)
    return ours if theirs is None else f"{ours} [{theirs}]"


def _notes(labels, columns, cells, settings, smooth) -> list[str]:
    """Over seeds only where every cell's runs have distinct seeds; else over runs, and
    each cell whose runs share seeds (replicas) named."""
    accuracy = "accuracy in %" + (f", EMA({parse_smooth(smooth):g})" if smooth else "")
    replicas = [render.replicas(_cell_title(label, s, settings), cell["n"], cell["seeds"])
                for label in labels for s in columns
                if (cell := cells.get((label, s))) and cell["seeds"] < cell["n"]]
    over = "the runs of a cell" if replicas else "seeds"
    return [f"mean ± std over {over}; {accuracy}"] + replicas


def _cell_title(label, setting: tuple, settings: list[str]) -> str:
    return render.value(label) + (f", {_setting_title(setting, settings)}" if settings else "")


def _completed(runs):
    """Paper tables compare finished runs only; say which were left out."""
    left_out = [run for run in runs if not run.completed]
    for run in left_out:
        click.echo(f"paper_table: leaving out {run.path} ({run.status})", err=True)
    if len(left_out) == len(runs):
        raise UsageError("none of the runs completed")
    return [run for run in runs if run.completed]


def _setting_title(values: tuple, keys: list[str]) -> str:
    return ", ".join(f"{render.key_header(k, keys)}={render.value(v)}" for k, v in zip(keys, values)) or "all"


def _metric_title(metric: str) -> str:
    if metric.startswith("rounds_to_"):
        return f"R@{100 * float(metric[len('rounds_to_'):]):g}%"
    return {"final_acc": "acc", "best_acc": "best", "linear_acc": "LP", "finetune_1pct_acc": "FT 1%",
            "finetune_10pct_acc": "FT 10%", "traffic_mb": "MB", "time_s": "s"}.get(metric, metric)


def _cell(row: dict | None, metric: str) -> str:
    if row is None:
        return "-"
    if metric.startswith("rounds_to_"):
        return render.rounds_stat(row[f"{metric}_mean"], row[f"{metric}_std"], row[f"{metric}_reached"],
                                  row["n"])
    return render.stat(row[f"{metric}_mean"], row[f"{metric}_std"], percent=_is_accuracy(metric))


def _is_accuracy(metric: str) -> bool:
    return metric.endswith("_acc") or metric.startswith("acc@")


def _csv_rows(labels, columns, cells, row_key, settings, metrics) -> list[dict]:
    """One CSV row per method; per setting n and seeds (distinct), per metric the raw
    mean, std (and reached)."""
    out = []
    for label in labels:
        row = {row_key: label}
        for s in columns:
            cell, title = cells.get((label, s)), _setting_title(s, settings)
            row[f"{title} n"] = cell["n"] if cell else None
            row[f"{title} seeds"] = cell["seeds"] if cell else None
            for m in metrics:
                for part in ("mean", "std") + (("reached",) if m.startswith("rounds_to_") else ()):
                    row[f"{title} {m}_{part}"] = cell[f"{m}_{part}"] if cell else None
        out.append(row)
    return out


if __name__ == "__main__":
    main()
