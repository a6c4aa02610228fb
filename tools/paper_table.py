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

Thin over fedmpi.analysis: group_table + pivot + render.
"""

from __future__ import annotations

import click

from fedmpi.analysis import differing_keys, group_table, pivot, render
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
@one_line_errors
def main(sources, row_key, setting, metric, at, target, smooth, fmt, strict):
    """Print a methods x settings table of the runs in FILES_OR_DIRS."""
    if fmt not in render.FORMATS:
        raise UsageError(f"--format {fmt!r}: allowed are {', '.join(render.FORMATS)}")
    if metric not in ("final", "best"):
        raise UsageError(f"--metric {metric!r}: allowed are final, best")
    runs = _completed(load_runs(sources, strict, False))
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
            click.echo(f"paper_table: {also}", err=True)
        return
    headers = [render.key_header(row_key, [row_key])] + [
        _setting_title(s, settings) + f" {_metric_title(m)}" for s in columns for m in metrics]
    body = [[render.value(label)] + [_cell(cells.get((label, s)), m) for s in columns for m in metrics]
            for label in labels]
    layout = render.markdown_table if fmt == "markdown" else render.text_table
    notes = ([also] if also else []) + _notes(labels, columns, cells, settings, smooth)
    click.echo(layout(headers, body) + "\n\n" + "\n".join(notes))


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
    return {"final_acc": "acc", "best_acc": "best"}.get(metric, metric)


def _cell(row: dict | None, metric: str) -> str:
    if row is None:
        return "-"
    if metric.startswith("rounds_to_"):
        return render.rounds_stat(row[f"{metric}_mean"], row[f"{metric}_std"], row[f"{metric}_reached"],
                                  row["n"])
    return render.stat(row[f"{metric}_mean"], row[f"{metric}_std"], percent=True)


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
