"""One CSV of a sweep: a row per run with its flattened config and summary metrics.

Columns: run (path), status, every config key (dotted: partition.alpha, train.lr, ...;
empty where a run lacks the key), then rounds_done, final_acc, best_acc, acc@R per --at,
rounds_to_T per --target (empty if never reached), traffic_mb, time_s, kappa, rho.
Accuracies are fractions. Runs that did not complete are included; filter on status.

    python tools/merge_runs.py runs/sweep -o all.csv --target 0.8 --smooth 0.9

Thin over fedmpi.analysis.runs_table.
"""

from __future__ import annotations

from pathlib import Path

import click

from fedmpi.analysis import render, runs_table
from fedmpi.analysis.cli import load_runs, parse_rounds, parse_smooth, parse_targets
from fedmpi.errors import UsageError, one_line_errors


@click.command()
@click.argument("sources", nargs=-1, required=True, metavar="FILES_OR_DIRS...")
@click.option("-o", "--output", metavar="FILE", help="CSV file to write (default: standard output).")
@click.option("--at", multiple=True, metavar="ROUND", help="Also the accuracy at this round (repeatable).")
@click.option("--target", multiple=True, metavar="ACC", help="Also the rounds to this accuracy, 0.8 or 80%.")
@click.option("--smooth", metavar="BETA", help="Accuracies from the EMA-smoothed curve, e.g. 0.9.")
@click.option("--strict", is_flag=True, help="Fail on a file that is not a fedmpi results file.")
@one_line_errors
def main(sources, output, at, target, smooth, strict):
    """Merge the runs in FILES_OR_DIRS into one CSV, a row per run."""
    runs = load_runs(sources, strict, False)
    table = runs_table(runs, None, parse_rounds(at), parse_targets(target), parse_smooth(smooth))
    text = render.csv_table(table)
    if not output:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text)
    except OSError as exc:
        raise UsageError(f"cannot write {output} ({exc.strerror or exc})") from exc
    click.echo(f"wrote {len(runs)} runs to {output}")


if __name__ == "__main__":
    main()
